"""The flat training configuration: the `train_config` dataclass (every field a `--field=value` flag,
with its help, choices and bounds; names and meanings are fms-fsdp's) and the checks that the flags
alone decide (`validate`: ranges, choices, flags that go together).

Reading flags and config files is flags.py's; what only a module can judge (the model variant, the
mesh, the tokenizer, the device) is checked at start-up by startup.py's `facts`. This module imports
nothing from the package but its errors.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import typing
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

from fms_fsdp.errors import ConfigError

# --tracker names; each is also the name of the package it needs
TRACKERS = ("tensorboard", "wandb", "aim", "mlflow")
# --pipeline_schedule: torch.distributed.pipelining's schedules, by its names
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# --lora_targets' default, every layer it may name: fms's names of the blocks' projections (lora.TARGETS;
# hf_read.FMS_PROJECTIONS says what each is in Hugging Face)
LORA_TARGETS = ("qkv_fused", "dense", "wg1_fused", "w2")


def _f(default: Any, help: str, choices: Sequence[Any] = (), min: Optional[float] = None, *, shared: bool) -> Any:
    """A dataclass field carrying its help text and constraints for validation and docs, and whether
    every --fault_tolerance replica group must share its value (`shared`: it sets a group's batches or
    updates; the model's and the mesh's flags are compared through the model config and mesh shape)."""
    meta = {"help": help, "choices": tuple(choices), "min": min, "shared": shared}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class train_config:
    """Every setting of a training run. Field names and meanings follow IBM's fms-fsdp."""

    # model
    model_variant: str = _f(
        "llama2_7b", "Model variant (e.g. llama2_7b, llama3_8b, 7b, tiny); see docs/configuration.md.", shared=False
    )
    vocab_size: Optional[int] = _f(
        None,
        "Vocabulary size; when given, overrides the variant's (for tokenizers of other sizes).",
        min=1,
        shared=False,
    )
    rope_theta: Optional[float] = _f(
        None,
        "Rotary base; when given, overrides the variant's (raise it to extend a model's context).",
        min=1,
        shared=False,
    )
    rope_scaling_factor: Optional[float] = _f(
        None,
        "Llama 3.1's rotary scaling (rope_type llama3: low_freq_factor 1, high_freq_factor 4, over the variant's original context) by this factor; 1: none; default: the variant's (8 for llama3.1_*, 32 for llama3.2_*).",
        min=1,
        shared=False,
    )
    norm_eps: Optional[float] = _f(
        None,
        "RMSNorm's epsilon; when given, overrides the variant's (a Hugging Face --ckpt_load_path's rms_norm_eps must match it).",
        shared=False,
    )
    max_position_embeddings: Optional[int] = _f(
        None,
        "Positions the model serves, as its Hugging Face exports say; when given, overrides the variant's (a Hugging Face --ckpt_load_path's must match it). A longer --seq_length extends it.",
        min=1,
        shared=False,
    )

    # mixture of experts
    moe_experts: Optional[int] = _f(
        None,
        "Experts per block: makes a dense variant a mixture of experts (Mixtral's routing, each expert as wide as the dense feed-forward layer), or changes a sparse variant's (tiny_moe, mixtral_8x7b, ...); default: the variant's.",
        min=1,
        shared=False,
    )
    moe_top_k: Optional[int] = _f(
        None,
        "Experts each token is routed to (at most --moe_experts); default: the variant's (2).",
        min=1,
        shared=False,
    )
    moe_shared_experts: Optional[int] = _f(
        None,
        "Shared experts every token passes through besides its routed ones (as DeepSeek's and Qwen's); default: the variant's (0).",
        min=0,
        shared=False,
    )
    moe_capacity_factor: float = _f(
        0.0,
        "0: dropless routing (every token reaches its experts). Above 0: each expert takes at most ceil(factor x tokens x top_k / experts) of a micro-batch's slots, in token order; the rest are dropped (the token keeps its residual) and counted as moe_dropped.",
        min=0.0,
        shared=True,
    )
    moe_kernel: str = _f(
        "auto",
        "How the experts' matmuls run: grouped (one grouped GEMM per weight for all experts, torch's grouped_mm; on a GPU it needs bf16), loop (one matmul per expert), auto (grouped on a GPU in bf16, else loop). Same results either way, within rounding.",
        choices=("auto", "grouped", "loop"),
        shared=False,
    )
    moe_aux_loss_weight: float = _f(
        0.01,
        "Weight of each MoE layer's load-balancing loss (Switch Transformer's as transformers' Mixtral computes it; top-k when balanced, reported as moe_balance_loss, the mean over layers), added to the training objective.",
        min=0.0,
        shared=True,
    )
    moe_z_loss_weight: float = _f(
        0.0,
        "Weight of each MoE layer's router z-loss (ST-MoE: the mean logsumexp(router logits)^2, reported as moe_z_loss), added to the training objective; 1e-3 in ST-MoE.",
        min=0.0,
        shared=True,
    )

    # data
    use_dummy_dataset: bool = _f(
        False, "Train on synthetic, learnable token lines instead of data_path (benchmarks, smoke tests).", shared=True
    )
    data_path: str = _f(
        "/fsx/data",
        "Folder (or object-storage URL, e.g. s3://bucket/prefix) holding one sub-folder per dataset: Arrow or Parquet shards (Hugging Face datasets' save_to_disk folders and cache files too), Megatron .bin/.idx pairs, OLMo/Dolma .npy token arrays, or raw text; a folder may mix them.",
        shared=False,
    )
    file_type: str = _f(
        "auto",
        "Which files of the dataset folders are read: auto (every layout, each file recognised by its name and first bytes), or only arrow (.arrow), hf_parquet (.parquet), megatron (.bin/.idx) or numpy (.npy token arrays).",
        choices=("auto", "arrow", "hf_parquet", "megatron", "numpy"),
        shared=True,
    )
    col_name: str = _f(
        "tokens",
        "Column holding the token ids (Arrow, Parquet). A file without a 'tokens' column but with exactly one list-of-integers column (datasets' input_ids) is read from that one, said once at start-up.",
        shared=True,
    )
    token_dtype: str = _f(
        "auto",
        "Dtype of headerless .npy token arrays (OLMo, Dolma): auto follows OLMo's rule, uint16 when the vocabulary fits (vocab_size <= 65536), else uint32. A .npy with numpy's header carries its own.",
        choices=("auto", "uint8", "uint16", "uint32", "uint64"),
        shared=True,
    )
    data_cache_dir: Optional[str] = _f(
        None,
        "Folder where the loader caches what it learns of the data files at start-up (counts, Arrow stream batch offsets, token arrays' documents, raw-text indexes), one sub-folder per data folder; default <ckpt_save_path>/data_cache. A folder shared by runs builds them once for all; 'meta' keeps them in each data folder's own meta/ (skipped where read-only).",
        shared=False,
    )
    text_field: str = _f(
        "text", "JSON key / Parquet column holding the text of raw text documents (with --tokenizer_path).", shared=True
    )
    cache_dir: Optional[str] = _f(
        None,
        "Levanter's cache_dir (local or s3://...): raw-text datasets are tokenized once with --tokenizer_path into <cache_dir>/<dataset> (fms-prepare-data's code and layout), while the run trains (--cache_build); a complete cache is reused as it is. Built on rank 0's node by its spare CPUs, or on Ray (--ray_address, --ray_start_workers, --ray_auto_start_cluster).",
        shared=True,
    )
    cache_build: Optional[str] = _f(
        None,
        "--cache_dir: when it is built (beside when not given). beside: from the first step, beside the training (the raw text's order; finished pieces read from the cache, the rest tokenized as read; a run that ends waits for the build); external: another job builds it (fms-prepare-data --output=<cache_dir>/<dataset>), the run only reads; first: before the first step, then read in the cache's own order (the only way in object storage or with --ray_start_workers). Not given, a resume keeps its checkpoint's order: first where it read its cache once built (with first, or made before this flag).",
        choices=("beside", "external", "first"),
        shared=True,
    )
    cache_workers: Optional[int] = _f(
        None,
        "--cache_dir tokenized in rank 0's process pool (no Ray flag): its processes. Default: the node's CPUs, less one per rank of the node while the run trains beside the build.",
        min=1,
        shared=False,
    )
    ray_address: Optional[str] = _f(
        None,
        "--cache_dir: HOST:PORT of a running Ray cluster that tokenizes the cache (pip install 'fms-fsdp[ray]').",
        shared=False,
    )
    ray_start_workers: bool = _f(
        False,
        "--cache_dir: start a Ray cluster over the job's own nodes (its head beside rank 0, each node's first rank a worker) to tokenize the cache, and stop it when the cache is done.",
        shared=False,
    )
    ray_auto_start_cluster: bool = _f(
        False,
        "--cache_dir without --ray_address: tokenize on a local Ray that rank 0 starts and stops (else rank 0's process pool).",
        shared=False,
    )
    datasets: Optional[list[str]] = _f(
        None,
        "Comma list of datasets: sub-folders of data_path (default: all but meta), or name=pattern|pattern entries whose files are anywhere, with brace ranges and globs, e.g. web=s3://b/web-{000..127}.jsonl.gz|s3://b/more/*.jsonl.gz (brace lists {a,b} in a config file's list, where commas do not split).",
        shared=False,
    )
    weights: Optional[list[float]] = _f(
        None,
        "Comma list of token proportions, one per dataset (default: each dataset's share of all tokens).",
        shared=True,
    )
    weights_schedule: Optional[str] = _f(
        None,
        "Weights that change at given steps (Levanter's stage weights): step:weights;step:weights, the first at step 0, e.g. '0:3,1,1;20000:1,1,2' (from the 20001st step on); instead of --weights.",
        shared=True,
    )
    seq_length: int = _f(4096, "Tokens per training sequence.", min=1, shared=True)
    bos_token: Optional[int] = _f(None, "Token id put before each document (none by default).", min=0, shared=True)
    eos_token: int = _f(0, "Token id separating documents.", min=0, shared=True)
    document_masking: bool = _f(
        False,
        "Attention stays inside each document of a packed line (documents end at eos_token), as Llama 3 trained: FlexAttention when compiled on CUDA, else SDPA with a mask.",
        shared=True,
    )
    document_positions: str = _f(
        "line",
        "Rotary positions with document_masking: line (a token's place in the line) or document (restarting at each document).",
        choices=("line", "document"),
        shared=True,
    )
    bol_token: Optional[int] = _f(
        None, "Token id put at the beginning of each line (none by default).", min=0, shared=True
    )
    eol_token: Optional[int] = _f(None, "Token id put at the end of each line (none by default).", min=0, shared=True)
    strip_tokens: list[int] = _f([], "Comma list of token ids stripped from both ends of every document.", shared=True)
    logical_shards: int = _f(1024, "Logical data shards (the unit of data-parallel rescaling).", min=1, shared=True)
    num_workers: int = _f(1, "Data loader worker processes per rank.", min=0, shared=False)

    # parallelism
    device: str = _f(
        "auto",
        "Device: cuda when one is available (NCCL), else cpu (gloo).",
        choices=("auto", "cuda", "cpu"),
        shared=False,
    )
    sharding_strategy: str = _f(
        "hsdp",
        "fsdp: shard over all ranks; hsdp: shard in a group, replicate across groups; ddp: replicate only. A run of one rank trains the module itself, without FSDP's parameter copies.",
        choices=("fsdp", "hsdp", "ddp"),
        shared=False,
    )
    sharding_group_size: Optional[int] = _f(
        None,
        "Data-parallel ranks one HSDP shard group spans (default: the node, LOCAL_WORLD_SIZE / --tensor_parallel_size).",
        min=1,
        shared=False,
    )
    cpu_offload: bool = _f(
        False,
        "FSDP2's CPU offload (torchtitan's): parameters, gradients and optimizer state stay on the host, each block's copied to the device for its use, and the optimizer steps on the CPU. Frees their device memory (--dry_run's first three lines) for slower steps: for a model that does not fit a few GPUs. Needs FSDP (more than one rank).",
        shared=False,
    )
    tensor_parallel_size: int = _f(
        1,
        "Tensor parallel: split every layer (heads, FFN width, vocabulary; the sequence for the norms) over this many ranks of a node, which see the same batch; data parallelism (--sharding_strategy) runs over world size / T. For models too big for FSDP alone or a global batch too small for every rank.",
        min=1,
        shared=False,
    )
    expert_parallel_size: int = _f(
        1,
        "Expert parallel: spread a sparse model's experts over this many ranks of each FSDP shard group (each holds experts / E of them, whole, and FSDP shards those over the group's other ranks); tokens reach their experts by all-to-all. Divides --moe_experts and the shard group; FSDP or HSDP only.",
        min=1,
        shared=False,
    )
    context_parallel_size: int = _f(
        1,
        "Ranks that split every line (context parallelism: each holds 2 of 2C chunks; keys and values all-gathered or passed round a ring, see cp_attention); FSDP shards over them too. Divides the world size / tensor_parallel_size; seq_length must divide by 2C.",
        min=1,
        shared=False,
    )
    cp_attention: str = _f(
        "allgather",
        "Attention across context_parallel_size ranks: allgather (each attention all-gathers the line's keys and values; any mask) or ring (torch's ring attention: keys and values passed rank to rank, C steps; causal lines only, bf16 on CUDA).",
        choices=("allgather", "ring"),
        shared=False,
    )
    pipeline_parallel_size: int = _f(
        1,
        "Pipeline stages' ranks (pipeline parallelism, outermost: across nodes): the blocks split into stages run by --pipeline_schedule; divides the world size.",
        min=1,
        shared=False,
    )
    pipeline_schedule: str = _f(
        "Interleaved1F1B",
        "torch.distributed.pipelining's schedule: GPipe and 1F1B run one stage per rank, Interleaved1F1B and InterleavedZeroBubble --pipeline_stages_per_rank looped, ZBVZeroBubble and DualPipeV two V-shaped.",
        choices=PIPELINE_SCHEDULES,
        shared=False,
    )
    pipeline_microbatches: int = _f(
        0,
        "Microbatches each step's --batch_size lines are cut into (the pipeline's gradient accumulation); 0: the fewest that divide --batch_size and are at least the stages.",
        min=0,
        shared=False,
    )
    pipeline_stages_per_rank: int = _f(
        0, "Stages (virtual stages) per pipeline rank; 0: 1 for GPipe and 1F1B, 2 for the others.", min=0, shared=False
    )
    pipeline_split: Optional[str] = _f(
        None,
        "Blocks of each stage, comma-separated (such as 3,5,5,3); default: balanced by cost (a block's parameters, the embedding's with the first stage, the head's with the last).",
        shared=False,
    )
    fsdp_activation_checkpointing: bool = _f(
        False, "Checkpoint activations of the blocks chosen by selective_checkpointing.", shared=False
    )
    selective_checkpointing: str = _f("1", "Fraction of blocks to checkpoint, e.g. 1, 0.5 or 1/3.", shared=False)
    ac_mode: str = _f(
        "block",
        "What activation checkpointing does in the chosen blocks: block (recompute all of it: least memory), op (matmul and attention outputs are kept, only the cheap element-wise ops are recomputed: torchtitan's selective policy, more memory, less recompute) or offload (what they save for backward goes to host memory and back, one tensor at a time: nothing recomputed, transfers instead).",
        choices=("block", "op", "offload"),
        shared=False,
    )
    mixed_precision: bool = _f(
        True,
        "bf16 compute with fp32 master weights, gradient reduction and optimizer state (FSDP2's bf16 parameters; on one rank, without FSDP, bf16 autocast).",
        shared=True,
    )
    float8: bool = _f(
        False,
        "Float8 matmuls in the blocks' Linear layers through torchao (extra float8; a GPU of compute capability 8.9+, emulated on CPU); checkpoints and exports stay the same.",
        shared=True,
    )
    float8_recipe: str = _f(
        "tensorwise",
        "Float8 scaling: tensorwise (one scale per tensor; weights all-gathered in float8) or rowwise (one per row: more accurate, slower).",
        choices=("tensorwise", "rowwise"),
        shared=True,
    )
    float8_min_size: int = _f(
        2048,
        "Only Linear layers with at least this many input and output features use float8 (smaller ones are slower in float8; 2048 from torchao's H100 tables).",
        min=16,
        shared=True,
    )
    collective_timeout_minutes: Optional[float] = _f(
        None,
        "A training collective (FSDP's, the loss report, the finite check) that waits longer fails the run with one line naming the lost peer, e.g. when a node dies without closing its connections (default: torch's, 10 min for NCCL, 30 for gloo; checkpoint and rank-0 work keep 30 min).",
        min=0.05,
        shared=False,
    )
    fault_tolerance: bool = _f(
        False,
        "Train as one of --ft_replica_groups replica groups (torchft, extra ft): each group is a torchrun job sharding with FSDP2 inside; gradients are averaged across the live groups, a group that dies is dropped at the next step and one that comes back gets the weights, optimizer and its data position live from a healthy group (docs/launching.md).",
        shared=False,
    )
    ft_replica_groups: Optional[int] = _f(
        None, "--fault_tolerance: replica groups of the job (default: $NUM_REPLICA_GROUPS).", min=1, shared=False
    )
    ft_group_index: Optional[int] = _f(
        None,
        "--fault_tolerance: this group's index, 0 .. groups - 1 (default: $REPLICA_GROUP_ID).",
        min=0,
        shared=False,
    )
    ft_lighthouse: Optional[str] = _f(
        None, "--fault_tolerance: the torchft lighthouse, host:port (default: $TORCHFT_LIGHTHOUSE).", shared=False
    )
    ft_min_replicas: int = _f(
        1, "--fault_tolerance: a step commits only when at least this many groups took part.", min=1, shared=False
    )
    ft_timeout_seconds: float = _f(
        60.0,
        "--fault_tolerance: how long a cross-group collective, the quorum or a live transfer may wait before the step is given up and retried with the groups still alive.",
        min=1.0,
        shared=False,
    )
    ft_step_timeout_seconds: float = _f(
        600.0,
        "--fault_tolerance: the watchdog: a group whose step (after its first) makes no progress for this long exits, so that the lighthouse drops it instead of the other groups waiting on a hung one (0: off).",
        min=0.0,
        shared=False,
    )
    low_cpu_fsdp: bool = _f(
        False, "Build the model on the meta device; each rank materialises only its shard.", shared=False
    )
    use_torch_compile: bool = _f(True, "torch.compile each transformer block.", shared=False)

    # training
    batch_size: int = _f(
        2,
        "Sequences per micro-batch per GPU (per tensor-parallel group with --tensor_parallel_size).",
        min=1,
        shared=True,
    )
    batch_size_schedule: str = _f(
        "",
        "Ramp the batch size: step:batch stages from step 0, e.g. 0:2,1000:4,3000:8 (2 lines per rank, as --batch_size counts them, then 4 once 1000 steps are done, ...); its largest stage is --batch_size; --ramp_unit=tokens counts tokens seen instead of steps. Exactly-once and exact resume hold across every change.",
        shared=True,
    )
    seq_length_schedule: str = _f(
        "",
        "Short lines first: step:length stages from step 0, e.g. 0:1024,2000:4096; its largest stage is --seq_length. The documents run on across a change: none is cut short or repeated.",
        shared=True,
    )
    ramp_unit: str = _f(
        "steps",
        "What the stage starts of --batch_size_schedule and --seq_length_schedule count: steps, or tokens seen by all data-parallel ranks together (each stage then starts at the first step before which that many were seen; a start-up note gives the stages in steps, as checkpoints record them; a resumed run keeps its checkpoint's steps as they were and counts the later stages from the tokens seen by then, on any number of data-parallel ranks).",
        choices=("steps", "tokens"),
        shared=True,
    )
    grad_accum_steps: int = _f(1, "Micro-batches accumulated per optimizer step.", min=1, shared=True)
    num_steps: int = _f(1000000, "Optimizer steps to train.", min=1, shared=True)
    seed: int = _f(2023, "Random seed for weights and data.", min=0, shared=True)
    deterministic: bool = _f(
        False,
        "Bit-identical runs: the same command twice gives the same losses and weights (every seed fixed, torch's deterministic algorithms, cuDNN's deterministic kernels without autotuning, cuBLAS's fixed workspace); an operation with no deterministic kernel stops the run in one line naming it. Not with --fault_tolerance. Its cost: docs/performance.md.",
        shared=True,
    )

    # optimizer
    learning_rate: float = _f(3e-4, "Peak learning rate.", min=0.0, shared=True)
    weight_decay: float = _f(0.1, "AdamW weight decay.", min=0.0, shared=True)
    adam_beta1: float = _f(0.9, "AdamW beta1.", min=0.0, shared=True)
    adam_beta2: float = _f(0.95, "AdamW beta2.", min=0.0, shared=True)
    adam_eps: float = _f(1e-8, "AdamW epsilon.", min=0.0, shared=True)
    grad_clip_thresh: float = _f(
        1.0, "Clip the global gradient norm to this value (0 disables clipping).", min=0.0, shared=True
    )
    z_loss_weight: float = _f(
        0.0,
        "z-loss: add this weight x logsumexp(logits)^2 per token to the training loss (1e-4 in PaLM and OLMo), which keeps the output logits from drifting; the term is reported as z_loss and included in loss. Evaluation reports cross entropy alone.",
        min=0.0,
        shared=True,
    )
    optimizer: str = _f(
        "adamw",
        "adamw; or muon: torch.optim.Muon's update (momentum, Newton-Schulz orthogonalisation) for the blocks' matrices, each orthogonalised whole however it is sharded, and AdamW for the embedding, head and norms (the Muon papers' split).",
        choices=("adamw", "muon"),
        shared=True,
    )
    muon_momentum: float = _f(
        0.95, "--optimizer=muon: the momentum of the matrices' updates (Nesterov).", min=0.0, shared=True
    )
    muon_adjust_lr: str = _f(
        "match_rms_adamw",
        "--optimizer=muon: how --learning_rate scales for a matrix of A x B: match_rms_adamw, 0.2 sqrt(max(A, B)), gives updates of AdamW's size so one learning rate serves both (Moonlight's); original, sqrt(max(1, A/B)) (Keller Jordan's, which wants a learning rate near 0.02).",
        choices=("match_rms_adamw", "original"),
        shared=True,
    )
    optimizer_state_dtype: str = _f(
        "fp32",
        "AdamW's two state buffers (momentum and variance): fp32, or int8: torchao's AdamW8bit (extra float8), a byte an element and a scale per block of 256, about 2 bytes a parameter for both instead of 8; the parameters, gradients and update stay fp32 (--optimizer_impl does not apply). Checkpoints hold the states in fp32, so a run can resume with either setting (a run short of memory switches to int8). Not with --optimizer=muon, --skip_bad_steps, --cpu_offload or --fault_tolerance.",
        choices=("fp32", "int8"),
        shared=True,
    )
    optimizer_impl: str = _f(
        "auto",
        "AdamW kernels: fused (one kernel for all parameters; on CUDA and CPU), foreach, or auto: fused where the device has it, which measured fastest on both.",
        choices=("auto", "fused", "foreach"),
        shared=False,
    )
    skip_bad_steps: int = _f(
        0,
        "Skip (no optimizer update) a step whose global gradient norm is not finite or spikes (see spike_sigma), up to this many in a row, then stop; 0: a non-finite step stops the run.",
        min=0,
        shared=True,
    )
    spike_sigma: Optional[float] = _f(
        6.0,
        "With skip_bad_steps: a gradient norm more than this many standard deviations above the mean of the last 128 kept steps is a spike (none: skip non-finite steps only).",
        min=0.0,
        shared=True,
    )
    weight_decay_norms_and_embeddings: bool = _f(
        True,
        "Decay every weight, as fms-fsdp does; False exempts norms, biases and embeddings from weight decay (OLMo's and GPT-NeoX's choice).",
        shared=True,
    )

    # evaluation
    eval_data_path: Optional[str] = _f(
        None,
        "Held-out data, laid out as --data_path (every sub-folder is an eval dataset unless --eval_datasets names them).",
        shared=False,
    )
    eval_datasets: Optional[list[str]] = _f(
        None,
        "Eval datasets as --datasets gives them: folders under eval_data_path (default: all), or name=patterns.",
        shared=False,
    )
    eval_interval: int = _f(
        0, "Steps between evaluations on eval_data_path, one also at the last step (0: none).", min=0, shared=False
    )
    eval_batches: int = _f(
        0,
        "Lines evaluated per dataset: the first eval_batches x eval_batch_size, shared by the ranks (0: every line, one full pass).",
        min=0,
        shared=False,
    )
    eval_batch_size: Optional[int] = _f(
        None, "Lines per forward pass of a rank when evaluating (default: batch_size).", min=1, shared=False
    )
    eval_harness_tasks: Optional[str] = _f(
        None,
        "lm-eval-harness tasks (comma list of task, group or tag names; needs lm-eval and --tokenizer_path) scored on the model as it trains, at the last step and every eval_harness_interval steps; scored kinds only (multiple_choice, loglikelihood, loglikelihood_rolling).",
        shared=False,
    )
    eval_harness_interval: int = _f(
        0,
        "Steps between lm-eval-harness runs of eval_harness_tasks, one also at the last step (0: at the last step only).",
        min=0,
        shared=False,
    )
    eval_harness_include_path: Optional[str] = _f(
        None,
        "A folder of lm-eval task yaml files (lm-eval's --include_path): tasks of your own, on local data.",
        shared=False,
    )
    eval_harness_limit: int = _f(0, "Documents scored per harness task: the first N (0: all).", min=0, shared=False)

    # learning-rate schedule
    training_stage: str = _f(
        "initial",
        "initial: lr_schedule below; annealing: linear decay from learning_rate to 0.",
        choices=("initial", "annealing"),
        shared=True,
    )
    lr_schedule: str = _f(
        "cosine",
        "cosine: warmup then cosine to min_lr_ratio; linear: warmup then a straight line to min_lr_ratio; inv_sqrt: warmup then sqrt(warmup / step), not below min_lr_ratio; inv: warmup then 1 / (1 + (1/min_lr_ratio - 1) t / decay), reaching min_lr_ratio after the decay steps (Levanter's inv); wsd: warmup, stable, linear decay to min_lr_ratio; constant: warmup then flat (plotted in docs/configuration.md).",
        choices=("cosine", "linear", "inv_sqrt", "inv", "wsd", "constant"),
        shared=True,
    )
    lr_schedule_unit: str = _f(
        "steps",
        "What the learning-rate schedule counts: steps, or tokens (with --batch_size_schedule or --seq_length_schedule: the schedule, its warmup and decay move by a step's tokens over those of a step of the largest batch and lines, so a ramp does not distort it).",
        choices=("steps", "tokens"),
        shared=True,
    )
    lr_cycles: int = _f(
        1,
        "Run the schedule this many times over num_steps, each cycle warming up again (Levanter's cycles); warmup_steps and decay_steps then count per cycle.",
        min=1,
        shared=True,
    )
    lr_cycle_length: Optional[str] = _f(
        None,
        "Cycles of this many steps (1000; steps left over join the last cycle), this fraction of num_steps (0.25), or these lengths one after another (1000,2000,4000; steps left after them make one more cycle). Instead of --lr_cycles.",
        shared=True,
    )
    lr_cycle_ends: Optional[list[int]] = _f(
        None,
        "Cycles that end at these steps (e.g. 1000,3000,10000); the last cycle runs to num_steps. Instead of --lr_cycles.",
        shared=True,
    )
    warmup_steps: Optional[float] = _f(
        None,
        "Quadratic warmup: steps, or a fraction of the run (of each cycle) when below 1 (default: min(2000, steps // 20) of the run, or of each cycle, as fms-fsdp).",
        min=0,
        shared=True,
    )
    lr_rewarmup: Optional[float] = _f(
        None,
        "Warmup of every cycle after the first: steps, or a fraction of the cycle when below 1 (default: --warmup_steps; 0 goes straight on at the peak, Levanter's default).",
        min=0,
        shared=True,
    )
    decay_steps: Optional[float] = _f(
        None,
        "wsd: steps of the final decay (default: a fifth of the run or cycle); inv: steps to reach min_lr_ratio (default: the rest of the cycle). A fraction of the cycle when below 1.",
        min=0,
        shared=True,
    )
    min_lr_ratio: float = _f(
        0.1,
        "Final learning rate as a fraction of learning_rate (cosine, linear, inv_sqrt, inv, wsd).",
        min=0.0,
        shared=True,
    )

    # checkpoints
    ckpt_load_path: Optional[str] = _f(
        None,
        "Initialise the model (only) from a checkpoint folder, a Hugging Face folder or a .pth/.safetensors file (a path or an s3://... URL), when ckpt_save_path holds no checkpoint to resume.",
        shared=False,
    )
    ckpt_save_path: str = _f(
        "output",
        "Folder for this run's outputs: metrics.jsonl, config.yaml, checkpoints/ (resumed from when present), exports; a path or an object-storage URL (s3://bucket/prefix, gs://, az://).",
        shared=False,
    )
    checkpoint_interval: Union[int, str] = _f(
        10000,
        "Steps between checkpoints (one is also saved at the last step); 0 saves none at all, not even at the end or on a stop signal (benchmarks); auto: the time between saves that loses least to failures plus saving, sqrt(2 x save stall x expected_hours_between_failures) (Young), re-estimated from each measured save stall.",
        min=0,
        shared=False,
    )
    checkpoint_minutes: Optional[float] = _f(
        None, "Also save when this many minutes have passed since the last save.", min=0.0, shared=False
    )
    expected_hours_between_failures: Optional[float] = _f(
        None,
        "For --checkpoint_interval=auto: hours between failures of the whole job (default: 50000 GPU-hours / GPUs, at most a week: Llama 3 saw an unexpected interruption every 3.1 h on 16384 GPUs).",
        min=0.0,
        shared=False,
    )
    max_run_minutes: Optional[float] = _f(
        None,
        "End the run with a checkpoint once this many minutes have passed since it started, start-up included, less the longest save so far, so that the last save fits (HyperPod's time_limit); the same command resumes it. With --checkpoint_interval=0 the run just ends.",
        min=0.0,
        shared=False,
    )
    stop_exit_status: int = _f(
        0,
        "Exit status of every rank of a run that stops before --num_steps with its checkpoint saved (on SIGTERM or SIGUSR1, or at --max_run_minutes): 0, as under Slurm, whose requeue resumes the run; 143 on Kubernetes (scripts/train_k8s.sh sets it), whose controllers restart only pods that failed.",
        min=0,
        shared=False,
    )
    checkpoint_keep: int = _f(2, "Latest complete checkpoints kept.", min=1, shared=False)
    checkpoint_keep_policy: str = _f(
        "", "Checkpoints kept for good, by step, e.g. 'every 1000 until 10000, then every 5000'.", shared=False
    )
    checkpoint_keep_best: int = _f(
        0,
        "Also keep the this many best checkpoints by --checkpoint_monitor, measured by evaluation at their steps (needs --eval_data_path and an --eval_interval that is a multiple of --checkpoint_interval).",
        min=0,
        shared=False,
    )
    checkpoint_monitor: str = _f(
        "eval_loss",
        "The evaluation metric --checkpoint_keep_best ranks by: eval_loss, eval_ppl, eval_loss/<dataset>, or an lm-eval score harness/<task>/<metric> (lower is better for a loss, a perplexity or bits per byte, higher for anything else).",
        shared=False,
    )
    async_checkpoint: bool = _f(False, "Write checkpoints in the background while training goes on.", shared=False)
    on_checkpoint_error: str = _f(
        "stop",
        "A failed save stops the run (stop) or is reported and skipped (warn).",
        choices=("stop", "warn"),
        shared=False,
    )
    export_model_at_end: bool = _f(
        False, "At the end, write the whole model to <ckpt_save_path>/model_step_<N>.safetensors.", shared=False
    )
    export_interval: int = _f(
        0,
        "Also export the whole model every this many steps (0: never) to <ckpt_save_path>/exports/step_<N> (fms: model.safetensors; hf: a Hugging Face folder).",
        min=0,
        shared=False,
    )
    export_format: str = _f(
        "fms",
        "Periodic exports as fms (one safetensors file of this package's weights) or hf (config.json, model.safetensors and, with --tokenizer_path, the tokenizer: a folder transformers loads).",
        choices=("fms", "hf"),
        shared=False,
    )
    export_keep: int = _f(2, "Latest periodic exports kept.", min=1, shared=False)
    ema_decay: float = _f(
        0.0,
        "Keep an exponential moving average of the weights (after each step: average = decay x average + (1 - decay) x weights; e.g. 0.999; 0: off), sharded as the weights and where they are (the host with --cpu_offload), saved in checkpoints and evaluated beside them (eval_loss_ema).",
        min=0.0,
        shared=False,
    )
    ema_on_host: bool = _f(
        False,
        "Hold the --ema_decay average in host memory (pinned on a GPU), whatever --cpu_offload says: it then takes no device memory, for a copy of the rank's shards to the host after each step.",
        shared=False,
    )
    export_ema: bool = _f(
        False,
        "Exports (--export_interval, --export_model_at_end) hold the --ema_decay average instead of the trained weights; checkpoints keep both.",
        shared=False,
    )
    tokenizer_path: Optional[str] = _f(
        None,
        "A Hugging Face tokenizer folder (or tokenizer.json): datasets may then hold raw text (.jsonl, .jsonl.gz, .json.gz; .parquet text columns with --file_type=auto or hf_parquet), tokenized on the fly; also copied into --export_format=hf exports.",
        shared=False,
    )

    # LoRA
    lora_rank: int = _f(
        0,
        "LoRA: train rank-r adapters of --lora_targets, every other weight frozen, from --ckpt_load_path (0: train every weight).",
        min=0,
        shared=True,
    )
    lora_alpha: float = _f(
        16.0, "LoRA: the adapters' output is scaled by lora_alpha / lora_rank.", min=0.0, shared=True
    )
    lora_dropout: float = _f(0.0, "LoRA: dropout on the adapters' input (< 1).", min=0.0, shared=True)
    lora_targets: list[str] = _f(
        list(LORA_TARGETS),
        "LoRA: the block layers adapted (fms names: qkv_fused = q/k/v, dense = attention output, wg1_fused = gate/up, w2 = down).",
        shared=True,
    )

    # memory plan
    dry_run: bool = _f(
        False,
        "Rehearse the start at --plan_world_size and print the memory plan of these flags (per rank: parameters, gradients, optimizer state, gathered blocks, activations, loss, predicted peak; what fits), then exit, without a GPU or a real process group: one rank per pipeline stage joins torch's fake process group of that many ranks and runs the start's own parallelisation (mesh, TP, pipeline split, CP, FSDP2, the optimizer's first step) on the meta device; the plan's parameters, gradients and optimizer state are its real shards', a setting that fails there fails in one line, a --ckpt_load_path on this machine is checked as at a start (a Hugging Face folder's config.json field by field; one elsewhere is left to the run), and the status is 0 when the plan fits, 3 when it does not (the PLAN line last either way).",
        shared=False,
    )
    plan_world_size: Optional[int] = _f(
        None,
        "World size the --dry_run rehearsal and plan are for (default: this launch's; 8 ranks per node for HSDP's default group and tensor parallelism).",
        min=1,
        shared=False,
    )
    plan_device_memory_gib: Optional[float] = _f(
        None,
        "Device memory per rank the plan is checked against, GiB (default: the visible GPU's, else this machine's memory over its ranks).",
        min=0.001,
        shared=False,
    )

    # metrics
    report_interval: int = _f(
        100, "Steps between metric reports (printed and appended to metrics.jsonl).", min=1, shared=False
    )
    straggler_threshold: float = _f(
        1.3,
        "A rank whose own work per step (its blocks' forward compute and its data wait, apart from waiting for the others) is this many times the median rank's at --straggler_reports reports in a row is named in a warning with its host; every record has slowest_rank, slowest_rank_host and slowest_rank_ratio.",
        min=1.0,
        shared=False,
    )
    straggler_reports: int = _f(
        3, "Reports in a row a rank must be over --straggler_threshold to be named.", min=1, shared=False
    )
    peak_tflops: Optional[float] = _f(
        None, "Peak bf16 TFLOP/s of one device for MFU (default: looked up by GPU name).", min=0.0, shared=False
    )
    tracker: Optional[list[str]] = _f(
        None,
        "Experiment trackers, comma-separated: tensorboard, wandb (WANDB_MODE=offline works without a network), aim, mlflow (the server of MLFLOW_TRACKING_URI, else a local store in --tracker_dir); none by default.",
        choices=TRACKERS,
        shared=False,
    )
    tracker_dir: Optional[str] = _f(None, "Folder for tracker files (default: <ckpt_save_path>/tracker).", shared=False)
    tracker_project_name: str = _f("llama", "Project (wandb) or experiment (aim, mlflow) name.", shared=False)
    tracker_run_id: Optional[str] = _f(
        None,
        "Tracker run id to go on with (default: the id saved in <ckpt_save_path>/tracker_runs.json, else a new run).",
        shared=False,
    )

    # profiler
    use_profiler: bool = _f(
        False,
        "Record torch.profiler traces (CPU and CUDA) of the 4th to 6th steps this process trains (after one skipped and two warm-up steps; a resumed run counts from where it resumed).",
        shared=False,
    )
    profiler_rank0_only: bool = _f(True, "Profile rank 0 only (else every rank writes its own trace).", shared=False)
    profiler_dir: Optional[str] = _f(
        None, "Folder for profiler traces (default: <ckpt_save_path>/profiler).", shared=False
    )
    profiler_memory_snapshot: bool = _f(
        False,
        "With use_profiler on CUDA: also record the allocator's history up to the end of the profiled steps and write memory_snapshot_rank<N>.pickle per profiled rank (view it at pytorch.org/memory_viz).",
        shared=False,
    )


# fms-fsdp flags that scripts pass and that mean nothing here: accepted, with a note, and dropped
IGNORED_FMS_FSDP_FLAGS = {
    "resuming_dataset": "a resumed run always restores its data position",
}

FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(train_config)}
HINTS: dict[str, Any] = typing.get_type_hints(train_config)


def parse_fraction(name: str, value: str) -> Fraction:
    """Parse '1', '0.5' or '1/3' exactly (no eval)."""
    try:
        return Fraction(value.strip())
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"--{name}: expected a number or a fraction like 1/3, got {value!r}") from None


def validate(cfg: train_config) -> None:
    """Check ranges, choices and cross-field rules; raise ConfigError naming the flag."""
    _check_ranges(cfg)
    _check_schedule(cfg)
    parse_fraction("selective_checkpointing", cfg.selective_checkpointing)
    _check_weights(cfg)
    _check_trackers(cfg)
    _check_evaluation_and_documents(cfg)
    _check_checkpoints(cfg)
    _check_paths_and_profiler(cfg)
    _check_cache(cfg)
    _check_weight_average(cfg)
    _check_optimizer_states(cfg)
    _check_untried_with_fault_tolerance(cfg)
    _check_ramp(cfg)
    if cfg.deterministic and cfg.fault_tolerance:
        raise ConfigError(
            "--deterministic with --fault_tolerance: replica groups come and go with the timing of failures, so "
            "no two runs are alike; leave one of them out"
        )
    if cfg.moe_kernel == "grouped" and not cfg.mixed_precision:
        raise ConfigError(
            "--moe_kernel=grouped with --mixed_precision=False: torch's grouped GEMM runs in bf16 only (on GPUs "
            "and compiled); use --moe_kernel=loop or auto for fp32"
        )


def _check_ramp(cfg: train_config) -> None:
    """--batch_size_schedule and --seq_length_schedule with what they combine with (read: ramp.py)."""
    ramped = [f for f in ("batch_size_schedule", "seq_length_schedule") if getattr(cfg, f)]
    if ramped and cfg.fault_tolerance:  # not run together yet (tests/composition.py)
        raise ConfigError(f"--{ramped[0]} does not combine with --fault_tolerance yet; leave one of them out")
    if ramped and cfg.pipeline_parallel_size > 1:
        raise ConfigError(
            f"--{ramped[0]} with --pipeline_parallel_size={cfg.pipeline_parallel_size}: a pipeline's stages are "
            "built for one shape of micro-batch; ramp without pipeline parallelism"
        )
    cp, tp = cfg.context_parallel_size, cfg.tensor_parallel_size
    unit = tp if cp == 1 else math.lcm(2 * cp, cp * tp)  # parallel/mesh.py's rules for a line's length
    stages = [stage.rpartition(":")[2].strip() for stage in cfg.seq_length_schedule.split(",")]
    short = [int(length) for length in stages if length.isdigit() and int(length) % unit]
    if short:
        raise ConfigError(
            f"--seq_length_schedule: lines of {short[0]} tokens do not split over --context_parallel_size={cp} "
            f"and --tensor_parallel_size={tp}: make every stage a multiple of {unit}"
        )
    if cfg.ramp_unit == "tokens" and not ramped:
        raise ConfigError(
            "--ramp_unit=tokens says what the stages of --batch_size_schedule and --seq_length_schedule count: "
            "give one of them, or leave it at steps"
        )
    if cfg.lr_schedule_unit == "tokens" and (cfg.lr_cycles > 1 or cfg.lr_cycle_ends or cfg.lr_cycle_length):
        raise ConfigError("--lr_schedule_unit=tokens counts one cycle: drop the --lr_cycle* flags")
    if cfg.lr_schedule_unit == "tokens" and not ramped:
        raise ConfigError(
            "--lr_schedule_unit=tokens: without --batch_size_schedule or --seq_length_schedule every step has "
            "the same tokens, so tokens count as steps; leave it at steps"
        )


def _check_optimizer_states(cfg: train_config) -> None:
    """--optimizer_state_dtype's low-bit states: torchao's AdamW, with what it combines with."""
    if cfg.optimizer_state_dtype == "fp32":
        return
    flag = f"--optimizer_state_dtype={cfg.optimizer_state_dtype}"
    other = {
        "--optimizer=muon": cfg.optimizer == "muon",
        "--skip_bad_steps (torch's fused AdamW leaves steps out)": cfg.skip_bad_steps > 0,
        "--cpu_offload (the optimizer steps on the host in fp32)": cfg.cpu_offload,
        "--fault_tolerance (a recovering group takes the states as fp32)": cfg.fault_tolerance,
    }
    clash = next((name for name, on in other.items() if on), None)
    if clash is not None:
        raise ConfigError(f"{flag} does not combine with {clash}; leave one of them out")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"{flag} needs torchao: pip install 'fms-fsdp[float8]'")


def _check_weight_average(cfg: train_config) -> None:
    """--ema_decay's average: exported only when kept, not kept by replica groups."""
    if cfg.ema_on_host and not cfg.ema_decay:
        raise ConfigError("--ema_on_host says where the weight average is held: set --ema_decay too (e.g. 0.999)")
    if cfg.export_ema and not cfg.ema_decay:
        raise ConfigError("--export_ema exports the weight average: set --ema_decay too (e.g. 0.999)")
    if cfg.ema_decay and cfg.fault_tolerance:
        raise ConfigError(
            "--ema_decay with --fault_tolerance: a replica group that catches up takes the weights, not the "
            "average, so the groups' averages would differ; leave one of them out"
        )


def _check_untried_with_fault_tolerance(cfg: train_config) -> None:
    """--fault_tolerance with features no run has tried it with yet: refused rather than trusted."""
    used = {"--lora_rank": bool(cfg.lora_rank), "--eval_harness_tasks": bool(cfg.eval_harness_tasks)}
    untried = [flag for flag, on in used.items() if on]
    if cfg.fault_tolerance and untried:
        raise ConfigError(f"--fault_tolerance does not combine with {untried[0]} yet; leave one of them out")


def _check_cache(cfg: train_config) -> None:
    """--cache_dir tokenizes raw text with --tokenizer_path; the Ray flags serve it alone."""
    if cfg.cache_dir is not None and cfg.tokenizer_path is None:
        raise ConfigError("--cache_dir tokenizes raw-text datasets: give --tokenizer_path too")
    ray = [f for f in ("ray_address", "ray_start_workers", "ray_auto_start_cluster") if getattr(cfg, f)]
    if cfg.cache_build is not None and cfg.cache_dir is None:
        raise ConfigError(f"--cache_build={cfg.cache_build} says when --cache_dir is built: give --cache_dir too")
    if cfg.cache_workers is not None and cfg.cache_dir is None:
        raise ConfigError("--cache_workers sizes the process pool that builds --cache_dir: give --cache_dir too")
    if cfg.cache_workers is not None and (ray or cfg.cache_build == "external"):
        builder = f"--{ray[0]}'s Ray cluster" if ray else "another job (--cache_build=external)"
        raise ConfigError(
            f"--cache_workers sizes rank 0's process pool, but {builder} builds --cache_dir; leave it out"
        )
    if ray and cfg.cache_dir is None:
        raise ConfigError(f"--{ray[0]} sets where --cache_dir is tokenized: give --cache_dir, or leave it out")
    if cfg.ray_address and cfg.ray_start_workers:
        raise ConfigError("--ray_address and --ray_start_workers: join a running cluster or start one, not both")


def _check_ranges(cfg: train_config) -> None:
    """Every field's choices and lower bound, and the flags that must stay below 1."""
    for name, f in FIELDS.items():
        value = getattr(cfg, name)
        choices, low = f.metadata["choices"], f.metadata["min"]
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if choices and v not in choices:
                raise ConfigError(f"--{name}: {v!r} is not one of {', '.join(str(c) for c in choices)}")
            if low is not None and not isinstance(v, str) and v < low:
                raise ConfigError(f"--{name}: must be >= {low}, got {v}")
    for name in ("adam_beta1", "adam_beta2", "lora_dropout", "ema_decay"):
        if not getattr(cfg, name) < 1:
            raise ConfigError(f"--{name}: must be < 1, got {getattr(cfg, name)}")
    if cfg.stop_exit_status > 255:
        raise ConfigError(f"--stop_exit_status: must be <= 255 (an exit status), got {cfg.stop_exit_status}")


def _check_schedule(cfg: train_config) -> None:
    """The learning-rate schedule's flags against --num_steps and each other."""
    if cfg.lr_cycles > cfg.num_steps:
        raise ConfigError(f"--lr_cycles={cfg.lr_cycles} is more than --num_steps={cfg.num_steps}")
    if cfg.min_lr_ratio > 1:
        raise ConfigError(f"--min_lr_ratio: must be <= 1, got {cfg.min_lr_ratio}")
    if cfg.lr_schedule == "inv" and cfg.min_lr_ratio == 0:
        raise ConfigError("--lr_schedule=inv decays towards --min_lr_ratio: give it a value above 0 (e.g. 0.1)")
    if cfg.decay_steps is not None and cfg.decay_steps > cfg.num_steps:  # per cycle: schedule.ScheduleSettings
        raise ConfigError(f"--decay_steps={cfg.decay_steps:g} is more than --num_steps={cfg.num_steps}")
    for flag in ("warmup_steps", "lr_rewarmup", "decay_steps"):
        value = getattr(cfg, flag)
        if value is not None and value >= 1 and value != int(value):
            raise ConfigError(f"--{flag}={value:g}: give a number of steps (an integer) or a fraction below 1")


def _check_brace_lists(flag: str, entries: Optional[list[str]]) -> None:
    """ConfigError when a comma list's entries hold a brace list {a,b} cut at its commas."""
    entries = entries or []
    cut = next((k for k, e in enumerate(entries) if e.count("{") > e.count("}")), None)
    if cut is None:
        return
    end = next((j for j in range(cut + 1, len(entries)) if "}" in entries[j]), len(entries) - 1)
    whole = ",".join(entries[cut : end + 1])
    name, pattern = whole.split("=", 1) if "=" in whole.split("{", 1)[0] else ("", whole)
    found = re.search(r"\{([^{}]*)\}", pattern)
    piped = found and "|".join(pattern[: found.start()] + alt + pattern[found.end() :] for alt in found[1].split(","))
    raise ConfigError(
        f"--{flag}: {whole} holds a brace list cut at its commas (commas separate datasets on the command line): "
        f"join its patterns with '|'{f' ({name}={piped})' if piped and name else f' ({piped})' if piped else ''}, "
        f"or give --{flag} as a list in a --config file"
    )


def _check_weights(cfg: train_config) -> None:
    """--weights: positive, one per dataset, and not given twice (--weights_schedule); --datasets and
    --eval_datasets without a brace list cut at its comma (the likely cause of a count that differs)."""
    _check_brace_lists("datasets", cfg.datasets)
    _check_brace_lists("eval_datasets", cfg.eval_datasets)
    if cfg.weights is not None and any(w <= 0 for w in cfg.weights):
        raise ConfigError(f"--weights: every weight must be > 0, got {cfg.weights}")
    if cfg.weights is not None and cfg.datasets is not None and len(cfg.weights) != len(cfg.datasets):
        raise ConfigError(f"--weights has {len(cfg.weights)} values but --datasets names {len(cfg.datasets)} datasets")
    if cfg.weights is not None and cfg.weights_schedule is not None:
        raise ConfigError("--weights and --weights_schedule both give the weights: put them in --weights_schedule")


def _check_evaluation_and_documents(cfg: train_config) -> None:
    """Evaluation's flags that go together (--eval_interval with --eval_data_path, the harness's with
    its tasks and a folder of them), and restarted positions with documents."""
    if (cfg.eval_interval > 0) != (cfg.eval_data_path is not None):
        raise ConfigError(
            "--eval_interval and --eval_data_path go together: set both (evaluation every N steps "
            "on that data) or neither"
        )
    if cfg.document_positions == "document" and not cfg.document_masking:
        raise ConfigError(
            "--document_positions=document restarts positions at each document: add --document_masking=True "
            "(documents that see each other need the line's positions)"
        )
    if not cfg.eval_harness_tasks and (cfg.eval_harness_interval or cfg.eval_harness_limit):
        raise ConfigError("--eval_harness_interval and --eval_harness_limit need --eval_harness_tasks: name the tasks")
    if cfg.eval_harness_include_path is not None and not Path(cfg.eval_harness_include_path).is_dir():
        raise ConfigError(
            f"--eval_harness_include_path: {cfg.eval_harness_include_path} is not a folder (of task yaml files)"
        )


def _check_checkpoints(cfg: train_config) -> None:
    """--checkpoint_interval (steps or auto), --checkpoint_keep_best, and --checkpoint_minutes with it."""
    if isinstance(cfg.checkpoint_interval, str) and cfg.checkpoint_interval != "auto":
        raise ConfigError(f"--checkpoint_interval: expected a number of steps or auto, got {cfg.checkpoint_interval!r}")
    _check_keep_best(cfg)
    if cfg.checkpoint_interval == "auto" and cfg.checkpoint_minutes is not None:
        raise ConfigError("--checkpoint_interval=auto chooses the time between saves: drop --checkpoint_minutes")
    if cfg.checkpoint_interval == 0 and cfg.checkpoint_minutes is not None:
        raise ConfigError(
            "--checkpoint_minutes needs checkpoints: --checkpoint_interval=0 saves none; "
            "set a --checkpoint_interval (e.g. 1000000 to save by time only)"
        )


def _check_paths_and_profiler(cfg: train_config) -> None:
    """The tokenizer exists, the memory snapshot has the profiler, and the trackers' and profiler's
    files get a local folder when checkpoints go to object storage."""
    if cfg.tokenizer_path is not None and not Path(cfg.tokenizer_path).exists():
        raise ConfigError(
            f"--tokenizer_path: {cfg.tokenizer_path} does not exist (a tokenizer folder or tokenizer.json)"
        )
    if cfg.profiler_memory_snapshot and not cfg.use_profiler:
        raise ConfigError("--profiler_memory_snapshot records the profiled steps: add --use_profiler=True")
    if is_object_storage(cfg.ckpt_save_path):  # the trackers' and the profiler's files need a local folder
        for flag, used, given in (
            ("tracker_dir", cfg.tracker, cfg.tracker_dir),
            ("profiler_dir", cfg.use_profiler, cfg.profiler_dir),
        ):
            if used and (given is None or is_object_storage(given)):
                raise ConfigError(
                    f"--{flag}: set a local folder: --ckpt_save_path={cfg.ckpt_save_path} is object "
                    "storage, where these files cannot be written as they grow"
                )


def _check_keep_best(cfg: train_config) -> None:
    """--checkpoint_keep_best ranks the checkpoints of eval steps: evaluation on, every eval step a
    checkpoint step, and an evaluation metric to rank by."""
    if not cfg.checkpoint_keep_best:
        return
    if cfg.checkpoint_monitor.startswith("harness/"):
        return _check_keep_best_by_harness(cfg)
    if not cfg.checkpoint_monitor.startswith("eval_"):
        raise ConfigError(
            f"--checkpoint_monitor={cfg.checkpoint_monitor!r}: name an evaluation metric "
            "(eval_loss, eval_ppl, eval_loss/<dataset> or harness/<task>/<metric>)"
        )
    interval = cfg.checkpoint_interval
    if cfg.eval_interval <= 0 or not isinstance(interval, int) or interval <= 0 or cfg.eval_interval % interval:
        raise ConfigError(
            f"--checkpoint_keep_best={cfg.checkpoint_keep_best} ranks checkpoints by {cfg.checkpoint_monitor} measured "
            f"at their steps: set --eval_data_path and an --eval_interval (now {cfg.eval_interval}) that is a "
            f"multiple of --checkpoint_interval (now {interval})"
        )


def _check_keep_best_by_harness(cfg: train_config) -> None:
    """--checkpoint_monitor=harness/<task>/<metric>: the tasks scored at checkpoint steps."""
    interval, every = cfg.checkpoint_interval, cfg.eval_harness_interval
    if not cfg.eval_harness_tasks or not isinstance(interval, int) or interval <= 0 or every <= 0 or every % interval:
        raise ConfigError(
            f"--checkpoint_keep_best={cfg.checkpoint_keep_best} ranks checkpoints by {cfg.checkpoint_monitor} scored "
            f"at their steps: set --eval_harness_tasks and an --eval_harness_interval (now {every}) that is a "
            f"multiple of --checkpoint_interval (now {interval})"
        )


def is_object_storage(path: str) -> bool:
    """Whether a path flag names object storage: a URL other than file:// (the one rule; storage.is_remote
    applies it to Paths and UPaths, and config imports nothing of the package)."""
    return "://" in path and not path.startswith("file://")


def _check_trackers(cfg: train_config) -> None:
    """Each tracker named once and installed (found without importing it)."""
    names = cfg.tracker or []
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"--tracker: {name} is named twice")
        if importlib.util.find_spec(name) is None:
            raise ConfigError(
                f"--tracker={name}: the {name} package is not installed; pip install {name} "
                f"(or drop {name} from --tracker)"
            )


def to_dict(cfg: train_config) -> dict[str, Any]:
    """The config as a plain dict (YAML/JSON serialisable)."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: train_config) -> str:
    """The config as YAML text, as saved to <ckpt_save_path>/config.yaml and read back by --config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
