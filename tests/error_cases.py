"""Every error message of the package, one registry: docs/troubleshooting.md's tables of messages are
generated from it (scripts/gen_docs.py), tests/test_errors.py drives the cases that give fms-train flags
(their start-up checks must end in that message) and fails when a message the package raises has no row.

A new message: add an `E(section, says, cause, fix)` row below, in its section (`says` as the user reads
it after `error: `, `<name>` for a value it names; cause and fix may stay empty when the message says
them), with `flags=` when fms-train's start-up checks raise it, then run `python scripts/gen_docs.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# the sections of docs/troubleshooting.md's generated tables, in order
SECTIONS = {
    "flags": "Flags and config files (at start-up, before any process group)",
    "data": "Data (at start-up; token ids on first sight) and the data tools",
    "parallel": "Meshes: tensor, context and pipeline parallelism (at start-up)",
    "training": "Training",
    "evaluation": "Evaluation and lm-eval tasks",
    "ft": "Fault tolerance (`--fault_tolerance`)",
    "trackers": "Trackers (at start-up, or while logging)",
    "checkpoints": "Checkpoints and exports",
    "hf": "Hugging Face (`fms_to_hf.py`, a Hugging Face `--ckpt_load_path`)",
    "tools": "fms-plot-metrics and fms-compare-runs",
}


@dataclass(frozen=True)
class E:
    """One message: its section, the line (`<name>` for a value), its cause and fix (empty: the message
    says them); `flags`: fms-train flags whose start-up checks end in it, on `world` ranks."""

    section: str
    says: str
    cause: str = ""
    fix: str = ""
    flags: Optional[tuple[str, ...]] = None
    world: int = 1


ERRORS: list[E] = [
    # ------------------------------------------------------------------------------------------------ flags
    E(
        "flags",
        "--deterministic with --fault_tolerance: replica groups come and go with the timing of failures, so no two "
        "runs are alike; leave one of them out",
        flags=("--deterministic=True", "--fault_tolerance=True"),
    ),
    E(
        "flags",
        "--<schedule> does not combine with --fault_tolerance yet; leave one of them out",
        "--batch_size_schedule or --seq_length_schedule with --fault_tolerance: not run together yet",
        flags=("--batch_size_schedule=0:1,10:2", "--batch_size=2", "--fault_tolerance=True"),
    ),
    E(
        "flags",
        "--batch_size_schedule with --pipeline_parallel_size=2: a pipeline's stages are built for one shape of "
        "micro-batch; ramp without pipeline parallelism",
        flags=("--batch_size_schedule=0:1,10:2", "--pipeline_parallel_size=2"),
        world=2,
    ),
    E(
        "flags",
        "--seq_length_schedule: lines of 30 tokens do not split over --context_parallel_size=2 and "
        "--tensor_parallel_size=1: make every stage a multiple of 4",
        flags=("--seq_length_schedule=0:30,10:64", "--seq_length=64", "--context_parallel_size=2"),
        world=2,
    ),
    E(
        "flags",
        "--lr_schedule_unit=tokens counts one cycle: drop the --lr_cycle* flags",
        flags=("--lr_schedule_unit=tokens", "--batch_size_schedule=0:1,10:2", "--lr_cycles=2"),
    ),
    E(
        "flags",
        "--lr_schedule_unit=tokens: without --batch_size_schedule or --seq_length_schedule every step has the same "
        "tokens, so tokens count as steps; leave it at steps",
        flags=("--lr_schedule_unit=tokens",),
    ),
    E(
        "flags",
        "--batch_size_schedule=1:2,10:4: give step:value stages from step 0 in increasing steps, e.g. 0:2,1000:4,3000:8",
        flags=("--batch_size_schedule=1:2,10:4", "--batch_size=4"),
    ),
    E(
        "flags",
        "--ramp_unit=tokens says what the stages of --batch_size_schedule and --seq_length_schedule count: give "
        "one of them, or leave it at steps",
        flags=("--ramp_unit=tokens",),
    ),
    E(
        "flags",
        "--batch_size_schedule=0:2,10:4: its largest stage is 4 but --batch_size=8; --batch_size is the largest stage "
        "(the memory plan's): set --batch_size=4",
        flags=("--batch_size_schedule=0:2,10:4", "--batch_size=8"),
    ),
    E(
        "flags",
        "--export_ema exports the weight average: set --ema_decay too (e.g. 0.999)",
        flags=("--export_ema=True",),
    ),
    E(
        "flags",
        "--ema_on_host says where the weight average is held: set --ema_decay too (e.g. 0.999)",
        flags=("--ema_on_host=True",),
    ),
    E(
        "flags",
        "--ema_decay with --fault_tolerance: a replica group that catches up takes the weights, not the average, so "
        "the groups' averages would differ; leave one of them out",
        flags=("--ema_decay=0.999", "--fault_tolerance=True"),
    ),
    E(
        "flags",
        "--optimizer_state_dtype=int8 does not combine with --optimizer=muon; leave one of them out",
        "torchao's 8-bit AdamW with Muon, --skip_bad_steps (which leaves steps out inside torch's fused AdamW) "
        "or --cpu_offload (whose optimizer steps on the host)",
        flags=("--optimizer_state_dtype=int8", "--optimizer=muon"),
    ),
    E("flags", "--optimizer_state_dtype=<dtype> needs torchao: pip install 'fms-fsdp[float8]'"),
    E(
        "flags",
        "--fault_tolerance does not combine with --lora_rank yet; leave one of them out",
        "fault tolerance with LoRA adapters or lm-eval-harness tasks (--eval_harness_tasks): no run has tried "
        "them together yet, so they are refused rather than trusted",
        flags=("--lora_rank=4", "--fault_tolerance=True"),
    ),
    E(
        "flags",
        "--moe_kernel=grouped with --mixed_precision=False: torch's grouped GEMM runs in bf16 only (on GPUs and "
        "compiled); use --moe_kernel=loop or auto for fp32",
        flags=("--moe_kernel=grouped", "--mixed_precision=False"),
    ),
    E(
        "flags",
        "unknown flag --lerning_rate; did you mean --learning_rate?",
        "a typo, or a flag of another tool",
        "use the suggested name; `python main_training.py --help` lists every flag",
        flags=("--lerning_rate=1",),
    ),
    E(
        "flags",
        "unknown flag --batch_sise in run.yaml; did you mean --batch_size?",
        "the same, in a `--config` file",
        "fix the key in the file",
    ),
    E(
        "flags",
        "--batch_size: expected int, got 'two'",
        "a value of the wrong type (`1e-4`, `1/3`, `a,b`, `True`, `None` are understood)",
        "give a value of the type shown in docs/configuration.md",
        flags=("--batch_size=two",),
    ),
    E(
        "flags",
        "--batch_size: must be >= 1, got 0",
        "a value out of range (also `--learning_rate=nan`, which is not a number)",
        "give a value in range",
    ),
    E(
        "flags",
        "--sharding_strategy: 'zero3' is not one of fsdp, hsdp, ddp",
        "not one of the choices",
        "pick one of those listed",
    ),
    E(
        "flags",
        "--model_variant: unknown variant 'llama9'; valid: tiny, ...",
        "no such variant",
        "pick one of those listed (aliases `7b`, `13b`, `34b`, `70b` work)",
    ),
    E("flags", "--adam_beta2: must be < 1", "out of range", "fix the value"),
    E(
        "flags",
        "--decay_steps=50 is more than --num_steps=10",
        "the WSD decay would start before step 0",
        "lower `--decay_steps`",
    ),
    E(
        "flags",
        "--selective_checkpointing: expected a number or a fraction like 1/3",
        "not a number",
        "`1`, `0.5` or `1/3`",
    ),
    E(
        "flags",
        "--weights has 1 values but --datasets names 2 datasets",
        "lists of different lengths",
        "one weight per dataset",
        flags=("--datasets=a,b", "--weights=1"),
    ),
    E(
        "flags",
        "--checkpoint_keep_policy: cannot read 'each 10'",
        "not the policy syntax",
        "`every 1000 until 10000, then every 5000`",
    ),
    E("flags", "--config: file not found", "the config file", "fix the path or its YAML/JSON"),
    E("flags", "--config: cannot parse ...", "the config file", "fix the path or its YAML/JSON"),
    E("flags", "--config: ... must hold a mapping", "the config file", "fix the path or its YAML/JSON"),
    E("flags", "--x needs a value: --x=...", "a flag without its value, a stray word", "write `--name=value`"),
    E("flags", "unexpected argument 'foo'", "a flag without its value, a stray word", "write `--name=value`"),
    E(
        "flags",
        "--tracker: 'mlflow' is not one of tensorboard, wandb, aim",
        "an unknown or repeated tracker",
        "`--tracker=tensorboard,wandb` (comma-separated, each once) or `none`",
    ),
    E(
        "flags",
        "--tracker: aim is named twice",
        "an unknown or repeated tracker",
        "`--tracker=tensorboard,wandb` (comma-separated, each once) or `none`",
    ),
    E(
        "flags",
        "--tracker=wandb: the wandb package is not installed; pip install wandb",
        "the tracker's package is missing in this environment",
        "install it (`pip install tensorboard`, `wandb` or `aim`) or drop it from `--tracker`",
    ),
    E(
        "flags",
        "--profiler_memory_snapshot records the CUDA allocator: ...",
        "a memory snapshot asked for on a run without a GPU",
        "drop the flag, or run on CUDA",
    ),
    E(
        "flags",
        "--profiler_memory_snapshot records the profiled steps: add --use_profiler=True",
        "the snapshot covers the profiler's steps",
        "add `--use_profiler=True`",
    ),
    E(
        "flags",
        "--device=cuda: no CUDA device is visible",
        "no GPU, or CUDA_VISIBLE_DEVICES hides it",
        "`--device=auto` or `--device=cpu`",
    ),
    E(
        "flags",
        "LOCAL_RANK 8 but only 8 GPUs are visible",
        "more processes than GPUs",
        "`--nproc_per_node` at most the GPU count",
    ),
    E(
        "flags",
        "--sharding_group_size=3 does not divide the world size 4",
        "HSDP groups must tile the ranks",
        "a divisor of the world size (default: ranks per node)",
    ),
    E(
        "flags",
        "torch <version> is older than <floor>, the oldest release this package supports; pip install 'torch>=<floor>'",
        "",
        "",
    ),
    E(
        "flags",
        "--datasets: code=/d/{code,heldout}/*.jsonl holds a brace list cut at its commas (commas separate datasets "
        "on the command line): join its patterns with '|' (code=/d/code/*.jsonl|/d/heldout/*.jsonl), or give "
        "--datasets as a list in a --config file",
        "a brace list `{a,b}` on the command line, whose commas split the datasets (so --weights seems to have "
        "too few values); also for --eval_datasets",
        "write the patterns joined by `|` as the message shows, or the list in a `--config` file",
        flags=("--datasets=web=/d/web/*.jsonl,code=/d/{code,heldout}/*.jsonl", "--weights=1,1"),
    ),
    E("flags", "--min_lr_ratio: must be <= 1, got <min_lr_ratio>"),
    E(
        "flags",
        "--lr_schedule=inv decays towards --min_lr_ratio: give it a value above 0 (e.g. 0.1)",
        flags=("--lr_schedule=inv", "--min_lr_ratio=0"),
    ),
    E("flags", "--weights: every weight must be > 0, got <weights>"),
    E("flags", "--weights and --weights_schedule both give the weights: put them in --weights_schedule"),
    E(
        "flags",
        "--eval_interval and --eval_data_path go together: set both (evaluation every N steps on that data) or neither",
        flags=("--eval_interval=5",),
    ),
    E(
        "flags",
        "--document_positions=document restarts positions at each document: add --document_masking=True (documents that see each other need the line's positions)",
        "",
        "",
    ),
    E("flags", "--eval_harness_interval and --eval_harness_limit need --eval_harness_tasks: name the tasks"),
    E("flags", "--eval_harness_include_path: <eval_harness_include_path> is not a folder (of task yaml files)"),
    E("flags", "--checkpoint_interval: expected a number of steps or auto, got <checkpoint_interval>"),
    E("flags", "--checkpoint_interval=auto chooses the time between saves: drop --checkpoint_minutes"),
    E(
        "flags",
        "--checkpoint_minutes needs checkpoints: --checkpoint_interval=0 saves none; set a --checkpoint_interval (e.g. 1000000 to save by time only)",
        "",
        "",
    ),
    E("flags", "--tokenizer_path: <tokenizer_path> does not exist (a tokenizer folder or tokenizer.json)"),
    E(
        "flags",
        "--checkpoint_monitor=<checkpoint_monitor>: name an evaluation metric (eval_loss, eval_ppl, eval_loss/<dataset> or harness/<task>/<metric>)",
        "",
        "",
    ),
    E(
        "flags",
        "--checkpoint_keep_best=<checkpoint_keep_best> ranks checkpoints by <checkpoint_monitor> measured at their steps: set --eval_data_path and an --eval_interval (now <eval_interval>) that is a multiple of --checkpoint_interval (now <interval>)",
        "",
        "",
    ),
    E(
        "flags",
        "--checkpoint_keep_best=1 ranks checkpoints by harness/hellaswag/acc scored at their steps: set "
        "--eval_harness_tasks and an --eval_harness_interval (now 0) that is a multiple of --checkpoint_interval "
        "(now 10)",
        flags=(
            "--checkpoint_keep_best=1",
            "--checkpoint_monitor=harness/hellaswag/acc",
            "--checkpoint_interval=10",
        ),
    ),
    E("flags", "--<name>: expected a number or a fraction like 1/3, got <value>"),
    E("flags", "--<name>: must be < 1, got <name>"),
    E("flags", "--<flag>=<value>: give a number of steps (an integer) or a fraction below 1"),
    E(
        "flags",
        "--<flag>: set a local folder: --ckpt_save_path=<ckpt_save_path> is object storage, where these files cannot be written as they grow",
        "",
        "",
    ),
    E("flags", "--config: <path><where> is a folder, not a config file"),
    E("flags", "--config: file not found: <path><where>"),
    E("flags", "--config: <path> must hold a mapping of field: value"),
    E("flags", "--config given more than once"),
    E("flags", "--config needs a value: --config=run.yaml"),
    E("flags", "unexpected argument <arg>: flags are written --name=value"),
    E(
        "flags",
        "--profiler_memory_snapshot records the CUDA allocator: this run has no GPU; drop the flag or run on CUDA",
        "",
        "",
    ),
    E("flags", "--<flag>=<path>: object storage needs <universal_pathlib>: pip install 'fms-fsdp[storage]'"),
    E(
        "flags",
        "--stop_exit_status: must be <= 255 (an exit status), got 256",
        "an exit status is 0 to 255",
        "fix the value",
    ),
    # ------------------------------------------------------------------------------------------------ data
    E("data", "--data_path: folder not found: /data", "wrong path, or not mounted on this node", "fix `--data_path`"),
    E(
        "data",
        "--data_path: /data has no dataset sub-folders",
        "shards directly under data_path",
        "put each dataset in its own sub-folder",
    ),
    E("data", "--datasets: no folder 'web' in /data", "a dataset named that is not there", "fix `--datasets`"),
    E(
        "data",
        "--weights has 2 values but /data has 3 datasets: a, b, c",
        "one weight per dataset is needed",
        "add weights or set `--datasets`",
    ),
    E(
        "data",
        "/data/web: no .arrow or .parquet or .bin or .idx or .npy files (--file_type=auto)",
        "no file of a layout this loader reads in the folder (with `--file_type=arrow`: no .arrow files)",
        "point `--data_path` at the dataset's folder, or set `--file_type` to its layout",
    ),
    E("data", "/data/web: the dataset has no documents", "empty shards", "remove the dataset or fill it"),
    E(
        "data",
        "/data/web/x.arrow: not a readable arrow shard (...)",
        "a truncated or corrupt Arrow file (Arrow's file and stream formats are both read)",
        "re-create it (`scripts/prepare_data.py`)",
    ),
    E("data", "/data/web/x.arrow: no column 'tokens' (columns: ids)", "another column name", "`--col_name=ids`"),
    E(
        "data",
        "/data/web/x.arrow: column 'tokens' has type string; expected integers ...",
        "raw text, not token ids",
        "tokenize it with `scripts/prepare_data.py`",
    ),
    E(
        "data",
        "/data/web/x.arrow: document 12 has token id 50300 >= vocab_size 50257",
        "tokenizer and model disagree",
        "`--vocab_size` of the tokenizer, or fix the data (`scripts/inspect_data.py` lists such documents)",
    ),
    E(
        "data",
        "/data/meta/counts.csv: expected the header dataset/filename,documents,tokens",
        "a malformed counts file",
        "fix or delete it (counts are then computed and cached)",
    ),
    E("data", "bad row", "a malformed counts file", "fix or delete it (counts are then computed and cached)"),
    E(
        "data",
        "... documents and --logical_shards=... give fewer logical shards than the 16 readers",
        "a tiny dataset and many ranks x workers",
        "more data, or fewer `--num_workers`",
    ),
    E(
        "data",
        "/data/web: every document is empty once stripped of bos/eos/strip_tokens",
        "documents made only of separators",
        "check `--eos_token`, `--bos_token`, `--strip_tokens` and the data",
    ),
    E(
        "data",
        "the data changed since this state was saved: documents was ..., is ...",
        "shards added or removed, or `--seed`/`--logical_shards` changed, since the checkpoint",
        "restore the data and flags, or start a new run (new `--ckpt_save_path`)",
    ),
    E(
        "data",
        "a single rank's loader state cannot be rescaled",
        "(API) `load_state_dict` got one rank's state for another world size",
        "pass the list of every rank's states",
    ),
    E(
        "data",
        "<flag> has <given> values but <data_path> has <names> datasets: <names>; give one weight per dataset or set --datasets",
        "",
        "",
    ),
    E(
        "data",
        "--tokenizer_path: <tokenizer_path> has <size> tokens but <model_variant>'s vocabulary is <vocab>; set --vocab_size=<size> (or larger)",
        "",
        "",
    ),
    E("data", "--<flag>=<value>: expected an integer >= <low> (or None)"),
    E("data", "--data_path is required: the folder holding one sub-folder per dataset"),
    E("data", "<path>: truncated or corrupt: <e>"),
    E("data", "loader state of <ranks> ranks given; the run had <world_size>"),
    E(
        "data",
        "<name>: <documents> documents and --logical_shards=<logical_shards> give fewer logical shards than the <readers> readers (data-parallel ranks x num_workers); add data or use fewer workers",
        "",
        "",
    ),
    E("data", "data loader state version <version> is not <STATE_VERSION>"),
    E("data", "a single rank's loader state cannot be rescaled: pass the list of every rank's states"),
    E(
        "data",
        "--weights_schedule: its stages must start at step 0 and go up, e.g. '0:3,1;1000:1,1'",
        flags=("--weights_schedule=5:1,1",),
    ),
    E(
        "data",
        "--weights_schedule: every stage must give one weight per dataset",
        flags=("--weights_schedule=0:1,1;5:1",),
    ),
    E(
        "data",
        "--weights_schedule: cannot read <part>; write step:weight,weight,...;step:... (weights >= 0, not all 0), e.g. '0:3,1,1;20000:1,1,2'",
        "",
        "",
        flags=("--weights_schedule=0:1,x",),
    ),
    E("data", "--<flag>=<value>: expected a positive integer"),
    E("data", "--input is required: a file, folder or glob of .jsonl/.jsonl.gz/.json/.parquet/.txt/.md"),
    E("data", "--input=<spec>: no <EXTENSIONS> files found"),
    E("data", "--tokenizer is required: a folder holding tokenizer.json, or byte"),
    E(
        "data",
        "--output=<output> holds input <index> made from <made_from>, but input <index> is now <path>; use a new --output or empty this one",
        "",
        "",
    ),
    E("data", "--output is required: <data_path>/<dataset>"),
    E("data", "--output=<output>: give <data_path>/<dataset> (meta is reserved for the counts files)"),
    E("data", "--output=<output> is a file; give a folder <data_path>/<dataset>"),
    E("data", "--input=<spec>: unsupported file type (expected <EXTENSIONS>)"),
    E("data", "<path>: cannot read it (<why>); fix or remove this input file"),
    E(
        "data",
        "--output=<output> was made with --<flag>=<old>, not <new>; use the same one or a new --output",
        "the output folder holds pieces tokenized with another tokenizer, text field, shard or piece size",
        "run with the settings it was made with, or give a new `--output`",
    ),
    E(
        "data",
        "--output=<out>: <n> of <total> pieces are not finished (the first: <path>, piece <part>); run the array's tasks again: each does only what is left",
        "`--finalize=True` ran before every task of the job array finished its pieces",
        "run the array again (finished pieces are skipped), then `--finalize=True` if you still want it",
    ),
    E("data", "--engine=<engine>: expected one of <ENGINES>"),
    E("data", "--task_index=<index>: expected 0 .. <last> (--num_tasks=<count>)"),
    E(
        "data",
        "--ray_address=<address>: no Ray cluster there (<why>); start one with `ray start --head`",
        "no Ray head at that address, or a cluster with token authentication and no `RAY_AUTH_MODE=token` here",
        "start the head (`ray start --head`), or set Ray's `RAY_AUTH_MODE=token` (with its token) as Ray's docs say",
    ),
    E("data", "--engine=ray needs Ray: pip install 'fms-fsdp[ray]'"),
    E("data", "--engine=ray: a task failed (<why>)"),
    E(
        "data",
        "the process pool's workers died 4 times (out of memory? see `dmesg`); finished pieces are kept: run the same "
        "command again, with fewer --workers",
        "the workers of fms-prepare-data's process pool (or of a rank's cache build) were killed again and again, "
        "most often by the kernel for memory",
        "fewer --workers (each holds a piece and the tokenizer); only the unfinished pieces are done again",
    ),
    E(
        "data",
        "the data loader's workers died 4 times in a row (signal 9; out of memory? see `dmesg`): resume from the last "
        "checkpoint, with fewer --num_workers",
        "a rank's data loader workers were killed again and again before they made a batch, most often by the kernel "
        "for memory; a single death only costs time: the workers start again from the last batch taken",
        "fewer --num_workers (each holds its readers and two batches ahead), then resume",
    ),
    E(
        "data",
        "--engine=ray: <kind> (<why>); run the same command again: finished pieces are kept",
        "a Ray worker died past its retries, or a node of the cluster left",
        "run the same command again; only the unfinished pieces are done",
    ),
    E(
        "data",
        "--cache_dir tokenizes raw-text datasets: give --tokenizer_path too",
        flags=("--use_dummy_dataset=False", "--cache_dir=cache"),
    ),
    E(
        "data",
        "--<flag> sets where --cache_dir is tokenized: give --cache_dir, or leave it out",
        flags=("--ray_address=head:6379",),
    ),
    E(
        "data",
        "--cache_workers sizes the process pool that builds --cache_dir: give --cache_dir too",
        flags=("--cache_workers=4",),
    ),
    E(
        "data",
        "--cache_workers sizes rank 0's process pool, but <builder> builds --cache_dir; leave it out",
        "--cache_workers with a Ray flag or --cache_build=external: rank 0's pool does not build the cache then",
        flags=("--cache_dir=cache", "--tokenizer_path=README.md", "--cache_workers=4", "--cache_build=external"),
    ),
    E(
        "data",
        "--ray_address and --ray_start_workers: join a running cluster or start one, not both",
        flags=(
            "--cache_dir=cache",
            "--tokenizer_path=README.md",
            "--ray_address=head:6379",
            "--ray_start_workers=True",
        ),
    ),
    E(
        "data",
        "--cache_dir: <output> was tokenized with <tokenizer> and --text_field=<field>, not <now> and --text_field=<field_now>; give another --cache_dir, or the tokenizer and text field it was made with",
        "the cache folder holds datasets tokenized by an earlier run with another tokenizer or text field",
        "give the run its own `--cache_dir`, or the tokenizer and text field the cache was made with",
    ),
    E("data", "--cache_dir: dataset <name> mixes raw text and token files; give each kind its own dataset"),
    E(
        "data",
        "--cache_dir: <output> is built with --<flag>=<value>, but a run reads and builds it with fms-prepare-data's default --<flag>=<default>; build it with the default, or give another --cache_dir",
        "another job (`--cache_build=external`) builds the cache with a non-default `--piece_bytes` or `--shard_tokens`",
    ),
    E(
        "data",
        "--cache_build=<when> says when --cache_dir is built: give --cache_dir too",
        flags=("--cache_build=external",),
    ),
    E(
        "data",
        "this checkpoint did not read its raw text while --cache_dir was built (it read the cache once built, or ran without --cache_dir): resume as it was made, with --cache_build=first or without --cache_dir",
        "the checkpoint was made by a run that read raw text without a cache, or it read its cache once built (--cache_build=first, or made before that flag) and this run says --cache_build=external",
        "resume with the flags it was made with; a new run can use --cache_build=beside",
    ),
    E(
        "data",
        "this checkpoint read its raw text while --cache_dir was built: resume with --cache_build=beside (or external) and the same --cache_dir to keep its batch order",
    ),
    E("data", "--ray_start_workers needs Ray: pip install 'fms-fsdp[ray]'"),
    E(
        "data",
        "--ray_start_workers: `ray start <args>` failed (<why>)",
        "Ray could not start its head beside rank 0 or join it from another node (a port taken, Ray's token authentication without a token)",
        "as Ray's last line says; with token authentication, give every node the token (`RAY_AUTH_TOKEN`) as Ray's docs say",
    ),
    E(
        "data",
        "--output=<output> holds <name> but --input matches only <n_inputs> files; use a new --output or empty this one",
        "",
        "",
    ),
    E("data", "--<datasets_flag>: <twice> given twice: each dataset once"),
    E("data", "<path>: no column <col_name> (columns: <names>); set --col_name"),
    E("data", "<path>: not a readable parquet file (<e>)"),
    E("data", "--<datasets_flag>: <entry> is not name=pattern|pattern..."),
    E(
        "data",
        "<path>: column <col_name> has type <ctype>; expected integers (one record batch per document, Arrow) or a list of integers (one row per document)",
        "",
        "",
    ),
    E("data", "--<flag>: <data_path> is a file, not a folder of datasets"),
    E("data", "<csv_path>: bad row <row>"),
    E("data", "<path>: raw text needs --tokenizer_path (a Hugging Face tokenizer)"),
    E("data", "--datasets: <name>'s patterns span file systems or buckets: give each its own dataset"),
    E("data", "--<datasets_flag>: <name>=<pattern> matches no file"),
    E("data", "--<datasets_flag>: <file> (<name>) is not one of <extensions>"),
    E("data", "token id <max> >= vocab_size <vocab_size> in --bos/eos/bol/eol tokens; set --vocab_size"),
    E(
        "data",
        "<file>: document <j> has token id <max> >= vocab_size <vocab_size>; set --vocab_size or fix the data",
        "",
        "",
    ),
    E("data", "--<flag>=<spec>: no tokenizer.json there (give a Hugging Face tokenizer folder or file)"),
    E(
        "data",
        "<path>: no column <text_field> (columns: <names>); set --text_field (raw text) or --col_name (token ids)",
        "",
        "",
    ),
    E("data", "<path>: column <text_field> has type <ctype>, not text; set --text_field"),
    E("data", "--<flag> needs the tokenizers package: pip install tokenizers"),
    E("data", "--<flag>: cannot load <path> (<e>)"),
    E("data", "<path>: cannot read it (<e>); fix or remove this file"),
    E(
        "data",
        "<path>: none of its <records> records has text (<reasons>); check --text_field (now <text_field>) and the file",
        "",
        "",
    ),
    E(
        "data",
        "data/part-00003.arrow: the Arrow stream is cut off midway (after 12 complete record batches, at byte 81920 "
        "of 90112); write the file again",
        "an Arrow stream file (what `datasets` writes) ends inside a record batch: a copy or a write was interrupted",
        "write or copy the file again",
    ),
    E(
        "data",
        "data/part-00000.arrow: column 'tokens' has type string; expected integers (one record batch per document) "
        "or a list of integers (one row per document)",
        "the column holds text or another type, not token ids",
        "point `--col_name` at the token column, or tokenize the text (`fms-prepare-data`)",
    ),
    E(
        "data",
        "data/train.parquet: column 'tokens' has type string; expected a list of integers (one row per document)",
        "the same, in a Parquet file",
        "point `--col_name` at the token column",
    ),
    E(
        "data",
        "data/train.parquet: not a readable parquet shard (<why>)",
        "a damaged or partly written Parquet file",
        "write the file again",
    ),
    E(
        "data",
        "data/web.bin: no web.idx beside it (a Megatron dataset is a .bin and .idx pair)",
        "one half of a Megatron indexed dataset is missing (also a lone .idx without its .bin)",
        "copy both files of the pair",
    ),
    E(
        "data",
        "data/web.idx: not a Megatron index (no MMIDIDX header)",
        "a file named .idx that Megatron did not write",
    ),
    E(
        "data",
        "data/web.idx: Megatron index version 2, this reader knows version 1",
        "an index of a newer Megatron format",
    ),
    E(
        "data",
        "data/web.idx: unknown Megatron dtype code 9 (known: 1 (uint8), 2 (int8), ...)",
        "an index of another format, or a damaged one",
    ),
    E(
        "data",
        "data/web.idx: cut off: 4096 bytes, its header says 8192",
        "a copy of the index was interrupted",
        "copy it again",
    ),
    E(
        "data",
        "data/web.bin: 1000 bytes, shorter than its .idx says (2048); the .bin is cut off or belongs to another .idx",
        "a truncated .bin, or a .bin and .idx of different datasets",
        "copy the pair again from where it was written",
    ),
    E("data", "data/part-0.npy: a .npy header numpy cannot read (<why>)", "a damaged `np.save` file"),
    E(
        "data",
        "data/part-0.npy: a .npy of shape (2, 3) and dtype float32; expected one row of integer token ids",
        "the array is not a flat array of token ids",
    ),
    E(
        "data",
        "data/part-0.npy: every other token is 0 read as uint16 by OLMo's rule for --vocab_size=32000: these are "
        "uint32 ids read as uint16; set --token_dtype=uint32",
        "a raw token array of uint32 ids read at half their width (OLMo's rule picks uint16 for a vocabulary of "
        "up to 65,536): every high half is 0",
        "set `--token_dtype=uint32`",
    ),
    E(
        "data",
        "data/corpus.idx: its dtype is int32 (code 4), but its documents' byte offsets step by 2 bytes a token; the "
        ".idx does not describe this .bin",
        "a Megatron .idx written for another .bin, or with the wrong dtype code",
        "write the .idx and .bin again together (Megatron's `tools/preprocess_data.py`)",
    ),
    E(
        "data",
        "data/part-0.npy: 1001 bytes is not a whole number of uint16 tokens (OLMo's rule for --vocab_size=32000); set "
        "--token_dtype to the dtype the file was written with",
        "a raw token array read with the wrong dtype, or cut off",
        "set `--token_dtype` (uint16, uint32, ...) as the file was written",
    ),
    E(
        "data",
        "data/part-0.npy: token id 70000 >= vocab_size 65536 (read as uint16 by OLMo's rule for --vocab_size=65536); "
        "the dtype is probably wrong: set --token_dtype, or --vocab_size",
        "token ids out of the vocabulary: the array was written with a wider dtype than the rule chose",
        "set `--token_dtype=uint32` (or the dtype it was written with), or the right `--vocab_size`",
    ),
    E("data", "data/part-0.csv.gz: cannot read Dolma's metadata (<why>)", "a damaged metadata file beside the array"),
    E(
        "data",
        "data/part-0.csv.gz: its document offsets do not tile the 5000 tokens of part-0.npy",
        "the metadata belongs to another array, or the array was cut off",
        "copy the array and its metadata again",
    ),
    E(
        "data",
        "data/notes.txt: not a file this loader reads (.arrow, .parquet, .bin, .idx, .npy or raw text)",
        "a file of another kind where `--file_type` names one layout",
        "move the file out of the dataset folder, or set `--file_type`",
    ),
    E("data", "--token_dtype=int7: expected one of auto, uint8, uint16, uint32, uint64", "(fms-inspect-data)"),
    E(
        "flags",
        "--moe_top_k=<k> routes each token to more experts than the model has (--moe_experts=<n>); lower it",
        flags=("--model_variant=tiny_moe", "--moe_top_k=5"),
    ),
    E(
        "flags",
        "--moe_top_k and --moe_shared_experts need --moe_experts on a dense variant (<variant>)",
        flags=("--moe_top_k=1",),
    ),
    # ------------------------------------------------------------------------------------------------ parallel
    E("parallel", "--pipeline_parallel_size=<pp> must divide the world size <world_size>"),
    E(
        "parallel",
        "--pipeline_parallel_size=<size> does not combine with <what> yet: <change> (--grad_accum_steps > 1, "
        "--eval_harness_tasks, an --eval_batch_size other than --batch_size, a head tied to the embedding)",
    ),
    E(
        "parallel",
        "--cpu_offload moves FSDP's shards to the host, but one rank per pipeline stage trains without FSDP; drop it, "
        "or train on more ranks",
        flags=("--cpu_offload=True",),
    ),
    E(
        "parallel",
        "--expert_parallel_size=2 needs a sparse model (tiny_moe, mixtral_*, or --moe_experts); this one is dense",
        flags=("--expert_parallel_size=2",),
        world=2,
    ),
    E(
        "parallel",
        "--expert_parallel_size=2 with --ac_mode=op: a per-op checkpointed block cannot recompute around the "
        "experts' own FSDP unit; use --ac_mode=block",
        flags=(
            "--model_variant=tiny_moe",
            "--expert_parallel_size=2",
            "--fsdp_activation_checkpointing=True",
            "--ac_mode=op",
        ),
        world=2,
    ),
    E(
        "parallel",
        "--expert_parallel_size=3 must divide the model's 4 experts; pick a divisor",
        flags=("--model_variant=tiny_moe", "--expert_parallel_size=3"),
        world=3,
    ),
    E(
        "parallel",
        "--expert_parallel_size=2 must divide the FSDP shard group (1 ranks: with --sharding_strategy=ddp there is "
        "none; use fsdp or hsdp)",
        flags=("--model_variant=tiny_moe", "--expert_parallel_size=2", "--sharding_strategy=ddp"),
        world=2,
    ),
    E(
        "parallel",
        "--expert_parallel_size=4 must divide the FSDP shard group (2 ranks)",
        "expert groups are cut out of each FSDP shard group (HSDP: --sharding_group_size)",
        "a divisor of the shard group, or a larger --sharding_group_size",
        flags=(
            "--model_variant=tiny_moe",
            "--expert_parallel_size=4",
            "--sharding_strategy=hsdp",
            "--sharding_group_size=2",
        ),
        world=4,
    ),
    E(
        "parallel",
        "--tensor_parallel_size does not combine with a mixture-of-experts model yet; drop it (FSDP/HSDP and "
        "pipeline stages shard one)",
        "tensor or context parallelism, float8, LoRA, or Hugging Face exports of shared experts, with a sparse "
        "variant (tiny_moe, mixtral_*) or --moe_experts",
        flags=("--model_variant=tiny_moe", "--tensor_parallel_size=2"),
        world=2,
    ),
    E(
        "parallel",
        "--pipeline_parallel_size=4 x 2 stage(s) per rank (the default of --pipeline_schedule=Interleaved1F1B) = 8 "
        "stages, more than tiny's 4 blocks: every stage needs a block; set --pipeline_stages_per_rank=1, use a "
        "one-stage schedule (--pipeline_schedule=1F1B or GPipe), or lower --pipeline_parallel_size",
        "the interleaved schedules (the default) hold 2 stages per rank unless told otherwise; a model has only so "
        "many blocks to split",
        flags=("--pipeline_parallel_size=4",),
        world=4,
    ),
    E(
        "parallel",
        "--pipeline_parallel_size=<pp> x <n> stage(s) per rank = <stages> stages, more than <variant>'s <blocks> "
        "blocks: every stage needs a block; lower --pipeline_stages_per_rank or --pipeline_parallel_size",
        flags=("--pipeline_parallel_size=2", "--pipeline_stages_per_rank=3"),
        world=2,
    ),
    E(
        "parallel",
        "--tensor_parallel_size=<tp> must divide the ranks per node (<local_world_size>) and the <world>: tensor parallelism stays inside a node",
        "",
        "",
    ),
    E("parallel", "--context_parallel_size=<cp> must divide the <world> / --tensor_parallel_size=<tp> = <tp>"),
    E(
        "parallel",
        "--sharding_group_size=<group> does not divide the <world> / --tensor_parallel_size=<tp> = <dp> data-parallel ranks; pick a divisor (default: ranks per node / <tp>)",
        "",
        "",
    ),
    E(
        "parallel",
        "--cp_attention=ring passes keys and values round the ranks for causal lines only: --document_masking=True "
        "needs --cp_attention=allgather",
        "ring attention (torch's) knows causal lines only, not documents packed in a line",
        "`--cp_attention=allgather` (the default), which masks documents",
        flags=("--context_parallel_size=2", "--cp_attention=ring", "--document_masking=True"),
        world=2,
    ),
    E(
        "parallel",
        "--cp_attention=ring runs CUDA's flash attention, which takes bf16: set --mixed_precision=True or --cp_attention=allgather",
        "",
        "",
    ),
    E(
        "parallel",
        "--context_parallel_size=3 cuts each line into 2 x 3 = 6 chunks: --seq_length=64 must be a multiple of 6",
        flags=("--context_parallel_size=3", "--seq_length=64"),
        world=3,
    ),
    E(
        "parallel",
        "--context_parallel_size=<cp> x --tensor_parallel_size=<tp>: each rank's <cp> tokens of a line must divide by <tp> (sequence parallel); pick a --seq_length that does",
        "",
        "",
    ),
    E(
        "parallel",
        "--context_parallel_size=<cp> with --use_torch_compile=True needs torch 2.13 or later (torch <version> computes wrong gradients there); set --use_torch_compile=False or upgrade torch",
        "",
        "",
    ),
    E("parallel", "--tensor_parallel_size=<tp> must divide the model's <what>, <n>; pick a divisor"),
    E(
        "parallel",
        "--tensor_parallel_size=<tp> does not combine with <flag> yet; use --tensor_parallel_size=1 (FSDP/HSDP) for it",
        "",
        "",
    ),
    E(
        "parallel",
        "--pipeline_schedule=<name> runs exactly 2 stages per rank, not --pipeline_stages_per_rank=<asked>",
        "",
        "",
    ),
    E(
        "parallel",
        "--pipeline_schedule=<name> needs torch 2.13 or later (torch <version> does not run it); use InterleavedZeroBubble or Interleaved1F1B, or upgrade torch",
        "",
        "",
    ),
    E(
        "parallel",
        "--pipeline_split=<text>: needs <stages> counts of at least 1 block (one per stage) adding up to the model's <n_blocks> blocks",
        "",
        "",
    ),
    E("parallel", "--pipeline_microbatches=<m> must divide --batch_size=<batch> (lines per step per pipeline)"),
    E(
        "parallel",
        "--pipeline_schedule=<name> needs at least as many microbatches as stages (<stages>), not <m>: raise --batch_size (and --pipeline_microbatches) or use GPipe",
        "",
        "",
    ),
    E(
        "parallel",
        "--pipeline_schedule=<name> needs --pipeline_microbatches a multiple of its rounds (<m> // <size> ranks = <rounds>), not <m>: use a multiple of <size>",
        "",
        "",
    ),
    E(
        "parallel",
        "--pipeline_schedule=<name> runs one stage per rank: --pipeline_stages_per_rank=<asked> needs Interleaved1F1B or InterleavedZeroBubble",
        "",
        "",
    ),
    E("parallel", "--pipeline_split=<text>: give the blocks of each stage as integers, such as 3,5,5,3"),
    E(
        "parallel",
        "--eval_interval does not run under --pipeline_schedule=ZBVZeroBubble yet (torch's V-shaped schedules cannot "
        "run forward only): use InterleavedZeroBubble or Interleaved1F1B for a run that evaluates",
        "torch's V-shaped schedules (ZBVZeroBubble, DualPipeV) fail in a forward-only pass",
        flags=(
            "--pipeline_parallel_size=2",
            "--pipeline_schedule=ZBVZeroBubble",
            "--eval_interval=2",
            "--eval_data_path=/data",
        ),
        world=2,
    ),
    E("parallel", "--device=cuda: no CUDA device is visible; use --device=cpu or --device=auto"),
    E(
        "parallel",
        "LOCAL_RANK <local_rank> but only <device_count> GPUs are visible: set torchrun's --nproc_per_node to at most the GPU count",
        "",
        "",
    ),
    # ------------------------------------------------------------------------------------------------ training
    E(
        "training",
        "lost contact with another rank (Connection reset by peer): a process or node of this run died or hung, its log "
        "has the cause; run the same command again to resume from the last checkpoint",
        "another rank's process died (its connection closed), or a node stopped answering for `--collective_timeout_minutes`",
        "read the other ranks' logs for the cause; run the same command again to resume from the last checkpoint",
    ),
    E(
        "training",
        "stopped after step 812: the launcher (torchrun) of a rank died; the checkpoint is saved, ...",
        "a torchrun was killed (by hand, an OOM killer); every rank saved and stopped",
        "run the same command again (on every node) to resume",
    ),
    E(
        "training",
        "step <step>: --deterministic: torch <version> has no deterministic <operation>, which this run uses; run "
        "without --deterministic, or without the flag that brings that operation in",
        "an operation of the run (on a GPU: some attention, pooling or scatter kernels) has no deterministic kernel "
        "in this torch",
        "drop --deterministic, or the feature that uses the operation (the message names it)",
    ),
    E(
        "training",
        "--config: a.yaml includes itself: a.yaml -> b.yaml -> a.yaml",
        "an `!include` cycle, or a path not relative to the including file",
        "fix the include",
    ),
    E(
        "training",
        "file not found: x.yaml (included from run.yaml)",
        "an `!include` cycle, or a path not relative to the including file",
        "fix the include",
    ),
    E(
        "training",
        "step 1234: 4 bad steps in a row (gradient norm not finite or over 6 sigma above its recent mean; --skip_bad_steps=3); ...",
        "with `--skip_bad_steps`, more bad steps in a row than allowed: the run has diverged, not a stray batch. The skipped steps left the model untouched",
        "lower `--learning_rate`, check the data around that step, resume from an earlier checkpoint",
    ),
    E(
        "training",
        "step 1234: the loss or gradient norm is not finite; ...",
        "divergence, or bad data. Noted on the device at the step it happened, read at the next report or checkpoint step (no per-step host sync): the model is never reported or saved past it",
        "lower `--learning_rate`, check the data around that step, resume from an earlier checkpoint",
    ),
    E(
        "training",
        "step 12: out of memory allocating 15.66 GiB on NVIDIA H100 80GB HBM3 (79.2 GiB, 61.3 GiB allocated); lower --batch_size (now 8) or checkpoint more blocks (...)",
        "the micro-batch's activations do not fit (CUDA)",
        "a smaller `--batch_size` (with `--grad_accum_steps` to keep the global batch), `--fsdp_activation_checkpointing=True` with a larger `--selective_checkpointing`, or more GPUs; `benchmarks/throughput.py --sweep=batch_size:...;selective_checkpointing:...` finds what fits. Checkpoints of earlier steps are untouched",
    ),
    E("training", "--ckpt_save_path: cannot append to <path> (<name>: <e>)"),
    E("training", "--float8=True needs torchao: pip install 'fms-fsdp[float8]' (or torchao)"),
    E(
        "training",
        "--float8=True needs a GPU of compute capability 8.9 or more (H100, H200, L4, B200); <device> is <capability>.<capability>",
        "",
        "",
    ),
    E(
        "training",
        "--lora_rank needs the model to adapt: set --ckpt_load_path (a Hugging Face folder, a checkpoint of this package or an export)",
        "",
        "",
    ),
    E(
        "training",
        "--lora_rank with --float8 is not supported: torchao's float8 layers drop the adapters; use one or the other",
        "",
        "",
    ),
    E(
        "training",
        "--lora_targets: unknown <given>; choose from <TARGETS> (q/k/v, attention output, gate/up, down projections)",
        "",
        "",
    ),
    E("training", "--skip_bad_steps leaves steps out inside the fused AdamW kernels, which <type> lacks"),
    E(
        "training",
        "--skip_bad_steps leaves steps out inside AdamW's fused kernels, which --optimizer=muon's matrices do not use: drop one of them",
        "",
        "",
    ),
    E(
        "training",
        "--optimizer=muon updates the blocks' matrices, which --lora_rank freezes: use AdamW for LoRA",
        "",
        "",
    ),
    E("training", "--optimizer_impl=fused: no fused AdamW on <type>; use foreach or auto"),
    E("training", "<given> both set the cycles: give one"),
    E(
        "training",
        "--lr_cycle_length=<text>: give steps (1000), a fraction of the run below 1 (0.25) or lengths (1000,2000)",
        "",
        "",
    ),
    E("training", "--decay_steps=<decay_steps> is more than the <shortest> steps of a cycle"),
    E("training", "--lr_cycle_ends=<ends>: give increasing steps from 1 to --num_steps=<n>"),
    E(
        "training",
        "step <first>: <what>; lower --learning_rate, check the data, or resume from an earlier checkpoint",
        "",
        "",
    ),
    E(
        "training",
        "a collective did not complete within --collective_timeout_minutes=5: rank 37 (host node04) did not reach "
        "all_gather #9312 of process group 3 (mesh_shard, input sizes [[1048576]]), which ranks 32 (host node04), ... "
        "waited in; each rank's stacks and last collectives: <ckpt_save_path>/diagnostics/<time>/rank<N>.txt "
        "(docs/troubleshooting.md); run the same command again to resume from the last checkpoint",
        "a rank stopped answering (a hung or frozen process, a node off the network) and the others waited past the timeout",
        "read the named rank's log and host; the dumps show what every rank was doing "
        "([reading a hang's dumps](#reading-a-hangs-dumps)); run the same command again to resume",
    ),
    E(
        "training",
        "a collective did not complete within --collective_timeout_minutes=5: rank 0's line names who; each rank's "
        "stacks and last collectives: ...",
        "the same, on the other ranks (written to torchrun's error file, not printed)",
        "read rank 0's line",
    ),
    E(
        "training",
        "a collective did not complete within --collective_timeout_minutes=5; cannot write <folder> (OSError: ...); "
        "run the same command again to resume from the last checkpoint",
        "the hang's dumps could not be written (a full or read-only disk)",
        "free the disk; run the same command again to resume",
    ),
    E(
        "training",
        "--dry_run: a rehearsal process died (out of memory, or killed); run it again, with fewer cores busy",
        "a process rehearsing a rank's start was killed (the machine ran out of memory, or a signal)",
        "run the dry run again; on a busy machine, when fewer processes hold memory",
    ),
    E(
        "training",
        "--dry_run: these flags fail at the start of rank 3 of 1024, where the model is parallelised: <what torch raised>",
        "a setting only the real wrapping (FSDP2, TP, pipeline split, CP) refuses",
        "change the flags the line names; the same flags would fail at the real start",
    ),
    # ------------------------------------------------------------------------------------------------ evaluation
    E("evaluation", "--eval_data_path: <name> has no document to evaluate"),
    E(
        "evaluation",
        "--eval_data_path: <name> holds token id <max>, not below the vocabulary size <vocab_size>",
        "",
        "",
    ),
    E(
        "evaluation",
        "--ckpt_load_path and --eval_data_path or --eval_harness_tasks are needed: the weights to evaluate and the data or tasks",
        "",
        "",
    ),
    E(
        "evaluation",
        "fms-evaluate runs the whole model on every rank: drop --pipeline_parallel_size=<pipeline_parallel_size> (training evaluates through its stages with --eval_data_path)",
        "",
        "",
    ),
    E(
        "evaluation",
        "evaluation takes whole models: drop --lora_rank and give --ckpt_load_path a LoRA run's merged export (model_step_<N>.safetensors or exports/step_<N>)",
        "",
        "",
    ),
    E("evaluation", "--eval_harness_tasks needs --tokenizer_path: the tasks are text, tokenized for the model"),
    E("evaluation", "--eval_harness_tasks: generation tasks do not run in the loop (load_tasks refuses them)"),
    E("evaluation", "--eval_harness_tasks needs lm-eval: pip install lm-eval (this package's [harness] extra)"),
    E(
        "evaluation",
        "--eval_harness_tasks: unknown task <name> (not among lm-eval's tasks<where>); did you mean <near>?",
        "",
        "",
    ),
    E("evaluation", "--eval_harness_tasks: cannot load <eval_harness_tasks> (<name>: <e>)"),
    E(
        "evaluation",
        "--eval_harness_tasks: <name> is a <kind> task; only scored tasks (<SCORED>) run in the loop",
        "",
        "",
    ),
    # ------------------------------------------------------------------------------------------------ ft
    E(
        "ft",
        "--fault_tolerance: fewer than --ft_min_replicas=<min_replicas> groups took part (<present>) for <failing_s> s (--ft_step_timeout_seconds): no step committed; start the other groups (scripts/train_ft.sh) or lower --ft_min_replicas",
        "",
        "",
    ),
    E(
        "ft",
        "--fault_tolerance: no quorum from the lighthouse <lighthouse> within <total_seconds> s (<e>): is it running? Started again, this group resumes from its checkpoint or catches up from a live group",
        "",
        "",
    ),
    E("ft", "--fault_tolerance needs --<flag> (or $<env>); $<env>=<text>"),
    E(
        "ft",
        "--fault_tolerance does not run with --pipeline_parallel_size > 1 yet: drop one of them (without "
        "--fault_tolerance a lost rank restarts the job from its last checkpoint)",
    ),
    E(
        "ft",
        "--fault_tolerance replicates across groups: each group shards with FSDP over its own ranks (at least 2; this group has <world_size>, mesh <dims>): use --sharding_strategy=fsdp, and one group per node or more",
        "",
        "",
    ),
    E(
        "ft",
        "--ft_group_index=<index> must be below --ft_replica_groups=<groups>",
        flags=("--fault_tolerance=True", "--ft_replica_groups=2", "--ft_group_index=2", "--ft_lighthouse=h:1"),
        world=2,
    ),
    E(
        "ft",
        "ft: step <N>: group <g> dropped (<cause>): <n> of <groups> groups train on",
        "not an error: a group died or hung (the cause in a few words: its connection broke, a collective timed "
        "out); its step did not commit and ran again with the live groups",
        "nothing for the others; start the group again (`scripts/train_ft.sh` does) and it catches up live",
    ),
    E(
        "ft",
        "ft: step <N>: group <g> joined (out for <k> steps): <n> of <groups> groups train on",
        "not an error: a group came back",
    ),
    E(
        "ft",
        "ft: group <g> caught up from a live group at step <N>: weights, optimizer and its data position",
        "not an error: a group that came back took the live state of another",
    ),
    E(
        "ft",
        "ft: step <N> did not commit (<n> group(s) took part, <cause>); it runs again with the live groups "
        "(<k> times in a row)",
        "a step failed again and again (said at the 1st, 10th, 100th... time), or too few groups take part "
        "(--ft_min_replicas)",
        "start the missing groups; after --ft_step_timeout_seconds without a commit the run stops in one line",
    ),
    E(
        "ft",
        "--ft_min_replicas=<ft_min_replicas> is more than the <groups> replica groups (--ft_replica_groups): no step could ever commit",
        "",
        "",
    ),
    E("ft", "--fault_tolerance needs the lighthouse: --ft_lighthouse=host:port or $TORCHFT_LIGHTHOUSE"),
    E("ft", "--ft_lighthouse=<lighthouse>: expected host:port (such as head-node:29510)"),
    E("ft", "--fault_tolerance needs torchft: pip install 'torchft==0.2.0' (extra ft)"),
    E(
        "ft",
        "--ft_lighthouse=<address>: nothing answers there after <seconds> s (<name>); start it with `torchft_lighthouse --min_replicas 1 --bind [::]:PORT` (scripts/train_ft.sh does)",
        "",
        "",
    ),
    # ------------------------------------------------------------------------------------------------ trackers
    E(
        "trackers",
        "--tracker=wandb: No API key configured. Use `wandb login` to log in (WANDB_MODE=offline logs without a network or an account)",
        "W&B online without a login",
        "`wandb login` or `WANDB_API_KEY`; or run offline and `wandb sync` later",
    ),
    E(
        "trackers",
        "--tracker=aim: Cannot find Run <hash> in aim Repo ...",
        "`--tracker_run_id` (or `tracker_runs.json`) names a run that is not in `--tracker_dir`",
        "the right `--tracker_dir`, or drop `--tracker_run_id` to start a new run",
    ),
    E(
        "trackers",
        "<ckpt_save_path>/tracker_runs.json is not valid JSON; delete it to start new tracker runs",
        "the run-id file was edited or damaged",
        "delete it (new tracker runs start) or restore it",
    ),
    E(
        "trackers",
        "--tracker=tensorboard: cannot write /path: Permission denied",
        "the tracker folder cannot be created",
        "another `--tracker_dir`",
    ),
    E(
        "trackers",
        "warning: --tracker=aim: ...; this resumed run goes on without it",
        "a tracker could not start again on a resumed run",
        "the run goes on; fix the tracker before the next attempt",
    ),
    E(
        "trackers",
        "warning: --tracker=wandb failed and is switched off: ...",
        "a tracker error during training (network, disk)",
        "training goes on and metrics.jsonl has every record; fix the cause before the next run",
    ),
    E("trackers", "<path> must map tracker names to run ids; delete it to start new tracker runs"),
    E(
        "trackers",
        "--tracker=mlflow: cannot reach the tracking server http://mlflow:5000 (MLFLOW_TRACKING_URI): start it (`mlflow "
        "server`) or unset MLFLOW_TRACKING_URI to log to a local store",
        "the MLflow server named by `MLFLOW_TRACKING_URI` does not answer (checked in about 4 s at start-up)",
        "start the server, fix the URI, or unset it to log under `--tracker_dir`",
    ),
    E(
        "trackers",
        "--tracker=mlflow: Run with id=<id> not found",
        "MLflow refused a call (its first line follows the colon): here a resumed run's MLflow run was deleted",
        "act on MLflow's message; remove `tracker_runs.json`'s mlflow entry to start a new MLflow run",
    ),
    # ------------------------------------------------------------------------------------------------ checkpoints
    E(
        "checkpoints",
        "not enough space in /ckpt/run/checkpoints for a checkpoint: 0.02 GiB free, about 0.06 GiB needed",
        "the disk is full even after pruning by the keep policy",
        "free space, or another `--ckpt_save_path`; `--on_checkpoint_error=warn` to go on without checkpoints",
    ),
    E(
        "checkpoints",
        "checkpoint save to /ckpt/run/checkpoints failed: ...",
        "an I/O error during the save (a read-only remount, a quota)",
        "fix the filesystem; the previous checkpoint is intact; `--on_checkpoint_error=warn` trains on without checkpoints (and warns once if metrics.jsonl cannot be appended to)",
    ),
    E(
        "checkpoints",
        "warning: cannot resume from .../step_12_ckp (.../step_12_ckp/metadata.pth: a file is damaged or truncated ...); trying .../step_6_ckp",
        "the newest checkpoint cannot be read (the message names the file)",
        "nothing to do: the run resumes from the older one, and the unreadable one is kept as `step_12_ckp.unreadable` for a look",
    ),
    E(
        "checkpoints",
        "no checkpoint under ... can be read (last error: ...)",
        "all checkpoints unreadable, or the run's settings (variant, vocab) changed",
        "restore the settings, or use a new `--ckpt_save_path` to start afresh",
    ),
    E(
        "checkpoints",
        "--ckpt_load_path: /x does not exist",
        "wrong path, or a path to something that is not weights (checked at start-up, status 2)",
        "a `step_N_ckp` folder, a Hugging Face folder or a `.safetensors`/`.pth` file",
    ),
    E(
        "checkpoints",
        "... is not a model file ...",
        "wrong path, or a path to something that is not weights (checked at start-up, status 2)",
        "a `step_N_ckp` folder, a Hugging Face folder or a `.safetensors`/`.pth` file",
    ),
    E(
        "checkpoints",
        "... is a run folder: ...",
        "wrong path, or a path to something that is not weights (checked at start-up, status 2)",
        "a `step_N_ckp` folder, a Hugging Face folder or a `.safetensors`/`.pth` file",
    ),
    E(
        "checkpoints",
        "--ckpt_load_path: /x: /x/__0_0.distcp is truncated (1,000 of 20,982,009 bytes); the checkpoint is damaged",
        "a copy or a save that did not finish",
        "copy it again, or another checkpoint",
    ),
    E(
        "checkpoints",
        "--ckpt_save_path: /ckpt/run belongs to a running run (pid ... on ..., started ..., heartbeat 4 s ago); ...",
        "another run writes there",
        "another `--ckpt_save_path`, or stop that run",
    ),
    E(
        "checkpoints",
        "export to .../model_step_N.safetensors failed: ...No space left on device...",
        "the disk filled up during the end-of-run export",
        "free space; the checkpoints are kept: `fms-export-model --load_path=.../step_N_ckp` writes it",
    ),
    E(
        "checkpoints",
        "--ckpt_load_path: /x does not fit --model_variant=tiny (vocab 2048): ...",
        "weights of another shape",
        "the variant and `--vocab_size` the weights were trained with",
    ),
    E(
        "checkpoints",
        "--ckpt_load_path: /hf: /hf: vocab_size is 512 but the model variant has 1024; ...",
        "a Hugging Face folder of another model",
        "the matching `--model_variant` / `--vocab_size`",
    ),
    E(
        "checkpoints",
        "refusing posix.system in checkpoint metadata",
        "a checkpoint whose `.metadata` holds code",
        "do not use it",
    ),
    E("checkpoints", "--save_path: <missing> must end in .safetensors"),
    E(
        "checkpoints",
        "export to <target> failed: <message>; the run's checkpoints are kept: export one with fms-export-model",
        "",
        "",
    ),
    E("checkpoints", "--load_path: cannot read <load_path>: <e>"),
    E("checkpoints", "--save_path: cannot write <save_path> (<name>: <e>)"),
    E(
        "checkpoints",
        "no checkpoint under <root> can be read (last error: <last_error>); if this run's settings changed on purpose, start it with a new --ckpt_save_path",
        "",
        "",
    ),
    E(
        "checkpoints",
        "<path> holds LoRA adapters of the base <base>, but --ckpt_load_path is now <load_path>; give the same base, or a new --ckpt_save_path",
        "",
        "",
    ),
    E("checkpoints", "cannot list the checkpoints in <root>: <message>"),
    E(
        "data",
        "the loader states are not one run's ranks: ranks <ranks> of world sizes <sizes>",
        "--ledger was given checkpoints of two runs, or of two world sizes",
        "give one run's checkpoints of one step (a fault-tolerant run: each group's of the same step)",
    ),
    E("data", "--ledger: the checkpoints are of different steps (<steps>): give one step's"),
    E("data", "--ledger: <folder> is not a checkpoint folder (no <name>)"),
    E("data", "--ledger: <folder> holds no loader_state_<rank>.pth: no data positions"),
    E("data", "--list_documents lists one checkpoint's documents: leave out --compare"),
    E("data", "--compare and --list_documents read a checkpoint's ledger: give --ledger=<checkpoint>"),
    E(
        "data",
        "the data changed since this checkpoint: <key> was <was>, is <value>",
        "--ledger read the data where the run read it (or at --data_path), and it is not the run's",
        "give --data_path the data the run trained on",
    ),
    E(
        "data",
        "--ledger: the run read synthetic lines (--use_dummy_dataset): there is no ledger",
    ),
    E("data", "--compare: the two runs read different datasets: they cannot be compared"),
    E(
        "checkpoints",
        "<where> has checkpoint layout <layout>, written by fms-fsdp <version>; this fms-fsdp (<installed>) reads "
        "layouts up to <LAYOUT>: upgrade it to resume or convert this checkpoint",
        "the checkpoint was written by a newer release, whose checkpoints hold more than this one reads",
        "install the release that wrote it (or a later one); a resume never falls back to an older checkpoint over it",
    ),
    E(
        "checkpoints",
        "--checkpoint_keep_policy: cannot read <part>; write e.g. 'every 1000 until 10000, then every 5000'",
        "",
        "",
    ),
    E("checkpoints", "<folder>: no model_state in this checkpoint"),
    E(
        "checkpoints",
        "--load_path: <folder> holds no weight average: its run trained without --ema_decay",
        "`fms-export-model --ema=True` on a checkpoint of a run without `--ema_decay`",
        "export its weights (leave out `--ema`)",
    ),
    E(
        "checkpoints",
        "<folder> is a LoRA checkpoint: it holds the adapters only, not a model; use the run's exports (model_step_<N>.safetensors, exports/step_<N>)",
        "",
        "",
    ),
    E("checkpoints", "<folder>: its .metadata is damaged or truncated (<name>: <e>)"),
    E(
        "checkpoints",
        "not enough space in <root> for a checkpoint: <free> GiB free, about <needed> GiB needed; free space or set --ckpt_save_path",
        "",
        "",
    ),
    E(
        "checkpoints",
        "--ckpt_load_path: <path> is neither a checkpoint folder (no .metadata) nor a Hugging Face folder (no config.json)",
        "",
        "",
    ),
    E(
        "checkpoints",
        "--ckpt_load_path: <path> is not a model file (<MODEL_FILES>), a checkpoint folder or a Hugging Face folder",
        "",
        "",
    ),
    E("checkpoints", "--ckpt_load_path: <path> is empty (0 bytes)"),
    E("checkpoints", "--ckpt_load_path: cannot read <path> (<name>: <e>)"),
    E(
        "checkpoints",
        "--ckpt_load_path: <path> is a run folder: give one of its checkpoints, <checkpoints>/step_<N>_ckp, or one of its exports",
        "",
        "",
    ),
    E(
        "checkpoints",
        "--ckpt_save_path: <root> belongs to a running run (<describe>); give this run another --ckpt_save_path, or stop that run first",
        "",
        "",
    ),
    E("checkpoints", "--ckpt_save_path: <root> was taken by another run starting at the same time"),
    E(
        "checkpoints",
        "--ckpt_save_path: <root> was taken over by another run (<who>) while this one was out of contact: this run stops without writing there",
        "",
        "",
    ),
    E("checkpoints", "--ckpt_save_path: cannot write <root> (<name>: <e>)"),
    # ------------------------------------------------------------------------------------------------ hf
    E(
        "hf",
        "a model with shared experts (--moe_shared_experts) has no Hugging Face export: Mixtral's layout has none; "
        "export it with --export_format=fms",
    ),
    E(
        "hf",
        "--model_variant is needed: ... does not record the variant",
        "an fms-fsdp checkpoint (no config inside)",
        "pass `--model_variant` (and `--vocab_size`)",
    ),
    E(
        "hf",
        "--model_variant=small does not match ...: base_model.embedding.weight is [512, 256] there, ...",
        "wrong variant or vocabulary",
        "the variant and `--vocab_size` of the run",
    ),
    E(
        "hf",
        "--load_path: ... is not a checkpoint folder (no .metadata)",
        "the `checkpoints/` folder or another folder",
        "a `step_N_ckp` folder or a `.safetensors`/`.pth` file",
    ),
    E(
        "hf",
        "--save_path: out exists and is not empty; choose a new folder",
        "nothing is ever overwritten",
        "a new folder",
    ),
    E("hf", "--dtype: 'fp8' is not one of bf16, fp32, fp16", "unsupported dtype", "one of those"),
    E(
        "hf",
        "--tokenizer_name_or_path: ... is not a local folder",
        "hub names are not fetched",
        "a local folder with the tokenizer files",
    ),
    E("hf", "<folder>: no config.json: not a Hugging Face model folder"),
    E("hf", "rope_scaling=<scaling> has no Hugging Face translation here (only rope_type llama3)"),
    E(
        "hf",
        "<folder>: rope_theta <theta> and rope_scaling <scaling>, but the run has rope_theta <our_theta> and rope_scaling <our_scaling>; choose the matching --model_variant (or --rope_theta, --rope_scaling_factor)",
        "",
        "",
    ),
    E(
        "hf",
        "--ckpt_load_path: <folder>: rms_norm_eps is 1e-06 but the run has 1e-05; set --norm_eps=1e-06",
        "the folder's model was trained with another RMSNorm epsilon than the variant's",
        "the flag it names (it is kept in the checkpoints and the exports)",
    ),
    E(
        "hf",
        "--ckpt_load_path: <folder>: max_position_embeddings is 2048 but the run has 1024; set "
        "--max_position_embeddings=2048",
        "the folder's model serves other positions than the variant",
        "the flag it names (exports then say the same)",
    ),
    E(
        "hf",
        "--ckpt_load_path: <folder>: tie_word_embeddings is true but tiny's embeddings are untied; choose a "
        "--model_variant whose embeddings are tied (llama3.2_* tie them)",
        "a model with one matrix for its embedding and output head, loaded into a variant with two (or the reverse)",
        "the variant it names",
    ),
    E(
        "hf",
        "--ckpt_load_path: <folder>: bos_token_id is 1 but the run puts --bos_token=5 before each document; set "
        "--bos_token=1",
        "the folder's model begins text with another id than the run puts before its documents",
        "the flag it names (the exports record the folder's id)",
    ),
    E("checkpoints", "give two or more checkpoint folders of one run to average (CKPT CKPT ...)"),
    E("checkpoints", "--out: give the new folder to write the averaged checkpoint to"),
    E("checkpoints", "--out=<out> exists: give a new folder (nothing is written over)"),
    E("checkpoints", "<path>: fms-average-checkpoints reads and writes local folders; copy it here first"),
    E("checkpoints", "<path> is not a complete checkpoint folder: give step_N_ckp folders of a run"),
    E("checkpoints", "--weights=<weights>: give numbers separated by commas, one per checkpoint"),
    E(
        "checkpoints",
        "--weights=<weights>: give one weight of at least 0 per checkpoint (<count>), not all 0",
    ),
    E(
        "checkpoints",
        "<path> and <last> hold different models (<tensor>: <shape> against <shape>): average checkpoints of one run",
        "fms-average-checkpoints was given checkpoints of runs with another variant, vocabulary or adapters",
        "give checkpoints of one run (the same flags)",
    ),
    E("hf", "<folder>: no .safetensors weights"),
    E("hf", "--model_variant is needed: <load_path> does not record the variant it was trained with"),
    E("hf", "--save_path is required: the folder to write"),
    E(
        "hf",
        "--load_path: <load_path> is not a checkpoint folder (no .metadata): give a step_N_ckp folder or a .safetensors/.pth file",
        "",
        "",
    ),
    E("hf", "--save_path: <save_path> exists and is not empty; choose a new folder (nothing is overwritten)"),
    E(
        "hf",
        "<folder>: <name> is <theirs> but the model variant has <ours>; choose the matching --model_variant (and --vocab_size)",
        "",
        "",
    ),
    E(
        "hf",
        "--ckpt_load_path: /hf/model-00002-of-00004.safetensors is truncated or not a safetensors file (12 bytes)",
        "a file too short to hold a safetensors header: an interrupted download or copy",
        "download or copy the folder again",
    ),
    E(
        "hf",
        "--ckpt_load_path: /hf/model-00002-of-00004.safetensors is damaged: its safetensors header is not JSON",
        "a damaged file",
        "download or copy it again",
    ),
    E(
        "hf",
        "--ckpt_load_path: /hf/model.safetensors.index.json is damaged: no weight_map (KeyError: 'weight_map')",
        "the index is not one transformers wrote",
        "write the folder again with `save_pretrained`",
    ),
    E(
        "hf",
        "--ckpt_load_path: /hf: no tensor model.layers.3.mlp.up_proj.weight in its safetensors files",
        "a folder of another architecture, or one with tensors missing",
        "use a LlamaForCausalLM folder whose layers match --model_variant",
    ),
    E(
        "hf",
        "--ckpt_load_path: /hf/model-00002-of-00004.safetensors is truncated (reading model.layers.3.mlp.up_proj.weight)",
        "the file ends before a tensor its header names: an interrupted download or copy",
        "download or copy the folder again",
    ),
    E(
        "hf",
        "--ckpt_load_path: /hf/model-00001-of-00004.safetensors: model.layers.0.mlp.up_proj.weight is F8_E4M3, "
        "a safetensors dtype this reader does not read (it reads F64, F32, F16, BF16, I64, I32, I16, I8, U8, "
        "BOOL); convert the weights to BF16, F16 or F32 first",
        "a quantized folder (FP8, for example), whose tensors are not in a dtype torch reads as plain weights",
        "load the unquantized (BF16) release, or dequantize it with transformers and `save_pretrained`",
    ),
    E(
        "hf",
        "--ckpt_load_path: base_model.lora_A has no Hugging Face counterpart",
        "the model holds a weight that has no place in a LlamaForCausalLM or MixtralForCausalLM folder",
        "report it: the package maps every weight of the variants it builds",
    ),
    E(
        "hf",
        "--ckpt_load_path: base_model.layers.0.ff_sub_layer.shared.w2.weight: a shared expert has no place in "
        "Mixtral's layout (--moe_shared_experts)",
        "a Hugging Face folder given to a model with shared experts",
        "load it into the variant without --moe_shared_experts",
    ),
    # ------------------------------------------------------------------------------------------------ tools
    E("tools", "<path>: no such metrics file (give a run's metrics.jsonl or its --ckpt_save_path)"),
    E("tools", "<path>: no metric records in it"),
    E("tools", "--x: <x> is not one of step, tokens"),
    E(
        "tools",
        "give two runs, A and B (got <n>): their metrics.jsonl or --ckpt_save_path folders",
        "fms-compare-runs takes two runs",
        "the run to check, then the reference",
    ),
    E("tools", "--rtol=<rtol> --atol=<atol>: tolerances are >= 0"),
    E("tools", "--steps=<n>: expected an integer >= 1 (or none: every step both runs have)"),
    E(
        "tools",
        "<A> and <B> have no training step in common: nothing to compare",
        "two runs whose records share no step (another --report_interval, or a run that has not reported yet)",
        "`--report_interval=1` in both runs",
    ),
    E("tools", "give one or more metrics.jsonl files (or run folders)"),
    E(
        "tools",
        "plotting needs matplotlib: pip install matplotlib (or the project's extra: pip install .[plot])",
        "",
        "",
    ),
]


def troubleshooting_tables() -> str:
    """The message tables of docs/troubleshooting.md, one per section (scripts/gen_docs.py)."""
    out = []
    for key, title in SECTIONS.items():
        out += [f"### {title}", "", "| message | cause | fix |", "|---|---|---|"]
        for e in ERRORS:
            if e.section == key:
                says = e.says.replace("|", "\\|")
                quoted = f"``{says}``" if "`" in says else f"`{says}`"
                out.append(f"| {quoted} | {e.cause or '—'} | {e.fix or 'as the message says'} |")
        out.append("")
    return "\n".join(out).rstrip()
