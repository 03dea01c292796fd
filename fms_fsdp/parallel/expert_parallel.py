"""Expert parallelism (--expert_parallel_size=E): each sparse block's experts are spread over E ranks of
every FSDP shard group, each rank holding experts / E of them whole (a DTensor sharded by expert), and
FSDP shards those over the ranks of the other expert groups (`expert_mesh`). A token's routed rows
reach the rank of their expert by an all-to-all and come back by another (`ExpertDispatch`), on gloo
or NCCL alike, with uneven splits: routing is dropless. As torchtitan's and OLMo-core's expert
parallelism. Every rank of an expert group adds the gradients of its tokens to the expert's one copy,
where data parallelism averages one copy per rank: each expert's gradient is scaled by 1 / E, which
FSDP's average over the copies' ranks then makes the average over the whole data-parallel world."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
from fms.models.llama import LLaMAConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from fms_fsdp.errors import ConfigError
from fms_fsdp.model.moe import MoEConfig, MoEFeedForward
from fms_fsdp.parallel.settings import MeshShape


def check_expert_parallel(shape: MeshShape, config: LLaMAConfig, op_checkpointing: bool) -> None:
    """ConfigError unless --expert_parallel_size can spread this model's experts: a sparse model whose
    experts it divides, without per-op activation checkpointing (whose recomputation does not meet the
    experts' own FSDP unit as the forward did; whole blocks are checkpointed fine)."""
    if shape.ep == 1:
        return
    if op_checkpointing:
        raise ConfigError(
            f"--expert_parallel_size={shape.ep} with --ac_mode=op: a per-op checkpointed block cannot recompute "
            "around the experts' own FSDP unit; use --ac_mode=block"
        )
    if not isinstance(config, MoEConfig):
        raise ConfigError(
            f"--expert_parallel_size={shape.ep} needs a sparse model (tiny_moe, mixtral_*, or --moe_experts); "
            "this one is dense"
        )
    if config.moe_experts % shape.ep:
        raise ConfigError(
            f"--expert_parallel_size={shape.ep} must divide the model's {config.moe_experts} experts; pick a divisor"
        )


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """A mesh over the ranks of `mesh` (pipeline, replicate, shard) with its shard dimension split into
    ('efsdp', 'ep'): consecutive shard ranks form an expert group ('ep', inside a node where the shard
    group is), and FSDP shards each expert over ('replicate', 'efsdp')."""
    names = tuple(mesh.mesh_dim_names or ())
    at = names.index("shard")
    ranks = mesh.mesh
    split = ranks.reshape(*ranks.shape[:at], ranks.shape[at] // ep, ep, *ranks.shape[at + 1 :])
    return DeviceMesh(mesh.device_type, split, mesh_dim_names=(*names[:at], "efsdp", "ep", *names[at + 1 :]))


def apply_expert_parallel(blocks: list[nn.Module], mesh: DeviceMesh) -> None:
    """Each sparse block's experts sharded by expert over mesh['ep'], its tokens dispatched to them."""
    ep = mesh["ep"]
    for block in blocks:
        layer = block.ff_sub_layer
        if not isinstance(layer, MoEFeedForward):
            continue
        for name, param in list(layer.cond_ffn.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep, [Shard(0)])
            layer.cond_ffn.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        layer.dispatch = ExpertDispatch(ep.get_group(), ep.size(), layer.experts)
        layer.cond_ffn.grad_scale = 1.0 / ep.size()


class ExpertDispatch:
    """Runs a layer's experts on rows sorted by expert when each of the group's `size` ranks holds
    `experts / size` of them: every rank sends each rank the rows for its experts (all-to-all), runs its
    own experts on what it received, and sends the outputs back (all-to-all), in the rows' order."""

    def __init__(self, group: dist.ProcessGroup, size: int, experts: int):
        self.group, self.size, self.local = group, size, experts // size

    @torch.compiler.disable
    def __call__(self, rows: torch.Tensor, counts: list[int], run: nn.Module) -> torch.Tensor:
        """The experts' outputs for `rows` ([sum(counts), dim], grouped by expert: `counts` rows each)."""
        ranks, local = range(self.size), range(self.local)
        sent = torch.tensor(counts, dtype=torch.int64, device=rows.device)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=self.group)
        received = got.view(self.size, self.local).tolist()  # one host copy: [source rank][my expert]
        to_rank = [sum(counts[r * self.local : (r + 1) * self.local]) for r in ranks]
        from_rank = [sum(row) for row in received]
        mine = self._exchange(rows[: sum(counts)], from_rank, to_rank)
        pieces = mine.split([n for row in received for n in row])  # by source rank, then expert
        by_expert = [pieces[s * self.local + j] for j in local for s in ranks]
        out = run(torch.cat(by_expert), [sum(received[s][j] for s in ranks) for j in local])
        done = out.split([received[s][j] for j in local for s in ranks])  # by expert, then source rank
        by_rank = [done[j * self.size + s] for s in ranks for j in local]
        return self._exchange(torch.cat(by_rank), to_rank, from_rank)

    def _exchange(self, rows: torch.Tensor, into: list[int], out_of: list[int]) -> torch.Tensor:
        """All-to-all of `rows` (out_of[r] of them to rank r), receiving into[r] from rank r; autograd
        sends the gradients back the same way."""
        out = rows.new_empty(sum(into), rows.shape[1])
        return dist_fn.all_to_all_single(out, rows.contiguous(), into, out_of, group=self.group)
