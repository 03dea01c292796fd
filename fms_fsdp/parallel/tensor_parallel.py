"""Tensor parallelism (Megatron's plan, as torchtitan writes it) with sequence and loss parallel."""

from __future__ import annotations

from fms.models.llama import LLaMA
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fms_fsdp.parallel.pipeline import blocks_of

# the Linear layers of a block that tensor parallelism splits by output features (the weight's rows:
# each rank its heads, its slice of the FFN width) and by input features (the weight's columns)
TP_COLWISE = ("attn.in_proj.query", "attn.in_proj.key", "attn.in_proj.value", "ff_sub_layer.wg", "ff_sub_layer.w1")
TP_ROWWISE = ("attn.dense", "ff_sub_layer.w2")


def apply_tensor_parallel(model: LLaMA, tp_mesh: DeviceMesh) -> None:
    """Split every layer over the `tp_mesh` ranks (Megatron's plan, as torchtitan writes it): q, k, v and
    the FFN's gate and up projections column-wise (each rank its heads, its slice of the width), the
    attention output and FFN down projection row-wise; the norms and the residual stream split over the
    sequence (sequence parallel: gathered before attention and the FFN, reduce-scattered after); the
    embedding and the head split over the vocabulary (the head's loss reduced over it: model/loss.py), one
    weight where the head is tied to the embedding.
    The model must be built unfused (fms's fused_weights=False)."""
    tp = tp_mesh.size()
    if model.base_model.embedding is not None:  # (a later pipeline stage has none)
        parallelize_module(
            model.base_model.embedding, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        )
    for block in blocks_of(model):
        parallelize_module(
            block,
            tp_mesh,
            {
                "ln": SequenceParallel(),
                "attn": PrepareModuleInput(
                    input_kwarg_layouts={"q": Shard(1)}, desired_input_kwarg_layouts={"q": Replicate()}
                ),
                "ff_ln": SequenceParallel(),
                "ff_sub_layer": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                **{name: ColwiseParallel() for name in TP_COLWISE},
                **{name: RowwiseParallel(output_layouts=Shard(1)) for name in TP_ROWWISE},
            },
        )
        block.attn.nheads //= tp  # fms shapes q, k, v by these: each rank computes its own heads
        block.attn.kvheads //= tp
    if model.head is not None:  # (nor does an earlier one a head)
        parallelize_module(model.base_model.dec_norm, tp_mesh, SequenceParallel())
        if model.config.tie_heads:  # the embedding's weight, split over the vocabulary as the head's is
            model.head.weight = model.base_model.embedding.weight
        else:
            model.head.weight = nn.Parameter(distribute_tensor(model.head.weight.data, tp_mesh, [Shard(0)]))
