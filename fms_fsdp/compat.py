"""Where this package leans on torch beyond its public API, or where supported torch releases (2.11 to
2.14) differ: one place, each entry saying what it is for and, for a difference, the releases it is
for. tests/test_compat.py imports every name here, so a torch release that moves one fails loudly
there, not in the middle of a run.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fms_fsdp.errors import ConfigError

# the oldest torch this package is tested on (requirements.txt, pyproject.toml and docs say the same)
OLDEST_TORCH = (2, 11)
TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def check_torch() -> None:
    """ConfigError on a torch older than the oldest release tested (installed with --no-deps): run at
    import, before the private imports below, so an older torch ends in one line, not an ImportError."""
    if TORCH < OLDEST_TORCH:
        floor = ".".join(map(str, OLDEST_TORCH))
        raise ConfigError(
            f"torch {torch.__version__} is older than {floor}, the oldest release this package "
            f"supports; pip install 'torch>={floor}'"
        )


check_torch()

# ----------------------------------------------------------------------------------- private APIs
# DTensor's placement arithmetic: which rows and columns of a parameter a mesh coordinate holds
# (local_box: init_weights draws each rank's own block, checkpoints read it; weights/fused.py tiles fused tensors)
# ShardedTensor: fms's fused keys for a model built unfused under tensor parallelism, which DCP saves
# and loads in place (a DTensor cannot place three pieces of one tensor on a rank)
# the CUDA allocator's history, for --profiler_memory_snapshot
from torch.cuda.memory import _record_memory_history as record_cuda_memory_history  # noqa: E402
from torch.cuda.memory import _snapshot as cuda_memory_snapshot  # noqa: E402
from torch.distributed import _functional_collectives as functional  # noqa: E402
from torch.distributed._functional_collectives import all_reduce as functional_all_reduce  # noqa: E402
from torch.distributed._functional_collectives import wait_tensor  # noqa: E402
from torch.distributed._shard.metadata import ShardMetadata  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata  # noqa: E402
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # noqa: E402

# a custom op's process group, passed by name (attention's ring)
from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: E402

# a mesh's groups get the --collective_timeout_minutes of the default group (torchtitan does the same)
from torch.distributed.distributed_c10d import _set_pg_timeout as set_group_timeout  # noqa: E402
from torch.distributed.tensor._utils import (  # noqa: E402
    _compute_local_shape_and_global_offset as local_shape_and_offset_at,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

# torch's ring attention (what torch.distributed.tensor.experimental.context_parallel runs under its
# SDPA dispatch), called with the attention kernels directly (--cp_attention=ring)
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_cp  # noqa: E402

# Muon's Newton-Schulz orthogonalisation and learning-rate adjustment, as torch.optim.Muon computes them
# (optim.MuonWithAdamW runs them on whole matrices gathered from their shards)
from torch.optim._muon import (  # noqa: E402
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _zeropower_via_newtonschulz,
)
from torch.optim._muon import _adjust_lr as muon_adjusted_lr  # noqa: E402

# maps the tensors of a nested state dict (checkpoints save float8's wrapped weights as plain tensors)
from torch.utils._pytree import tree_map_only  # noqa: E402


def in_backward() -> bool:
    """Whether autograd runs a backward now (where activation checkpointing recomputes a forward)."""
    return torch._C._current_graph_task_id() != -1


def mem_tracker() -> tuple[Any, Any, Any]:
    """(FakeTensorMode, MemTracker, _ModState): the memory plan traces activations on fake tensors with
    torch's module memory tracker (imported when a plan is made)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState

    return FakeTensorMode, MemTracker, _ModState


def fake_store() -> Any:
    """A FakeStore for torch's fake process group (collectives return at once, moving no data) of
    --dry_run's rehearsal; importing its module registers the backend (torchtitan's COMM_MODE=fake_backend)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fsspec_storage() -> tuple[Any, Any]:
    """(FsspecReader, FsspecWriter): DCP's reader and writer of fsspec filesystems, for checkpoints in
    object storage (imported when one is used: they need fsspec, an optional extra)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecReader, FsspecWriter


def loader_workers_died(it: Any) -> list[int]:
    """The exit codes of a DataLoader iterator's workers that died (negative: the killing signal)."""
    return [w.exitcode for w in getattr(it, "_workers", []) if w.exitcode not in (None, 0)]


def unwatch_loader_workers(it: Any) -> None:
    """A worker's death is found where its rank waits for a batch (a RuntimeError from next(it)), not
    raised by torch's SIGCHLD handler in whatever code the rank runs then."""
    if getattr(it, "_worker_pids_set", False):
        torch.utils.data._utils.signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False


# ----------------------------------------------------------------------------------- differences


def flight_recorder_dump() -> Optional[dict[str, Any]]:
    """This process's Flight Recorder record of its last collectives, every group's (`_dump_fr_trace`:
    gloo and NCCL record when TORCH_FR_BUFFER_SIZE is set before the groups are made; on 2.13 gloo records
    each collective's group, sequence number, sizes and whether it retired); None when there is none."""
    import pickle

    import torch._C._distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        return pickle.loads(dump(True, True, False))
    except Exception:  # a recorder never enabled, a release whose dump differs: no record, not an error
        return None


def group_members() -> dict[str, list[int]]:
    """The global ranks of every process group of this process by group name, as Flight Recorder names
    them (empty if a release moves the registry: the hang analysis then takes every rank as a member)."""
    import torch.distributed.distributed_c10d as c10d

    names, ranks = getattr(c10d._world, "pg_names", {}), getattr(c10d._world, "pg_group_ranks", {})
    return {names[group]: sorted(members) for group, members in ranks.items() if group in names}


def muon_orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of one matrix, with its default coefficients and steps."""
    return _zeropower_via_newtonschulz(matrix, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS)


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's part of `t` in the whole tensor (FSDP's rows, TP's rows or
    columns); a tensor that is not a DTensor is all of itself."""
    if not isinstance(t, DTensor):
        return (0,) * t.dim(), tuple(t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(offset), tuple(shape)


def local_tensor(value: Any) -> torch.Tensor:
    """A DTensor's local tensor itself (to_local() makes a new autograd view each call; a checkpoint's
    float8 unwrapping needs the object the DTensor holds); any other tensor as it is."""
    return value._local_tensor if isinstance(value, DTensor) else value


def matmul_and_attention_ops() -> list[Any]:
    """The aten ops of matmuls (the experts' grouped GEMMs too) and of SDPA's attention kernels (those of
    this release), whose outputs --ac_mode=op keeps; the grouped GEMM and attention kernels are private."""
    attention = ("flash_attention", "efficient_attention", "cudnn_attention", "flash_attention_for_cpu")
    names = ("mm", "addmm", "bmm", "_grouped_mm", *(f"_scaled_dot_product_{kernel}" for kernel in attention))
    return [getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)]


def reduce_scatter_op() -> Any:
    """The functional reduce-scatter that --ac_mode=op keeps under tensor parallelism (torchtitan's)."""
    return torch.ops._c10d_functional.reduce_scatter_tensor.default


def _functional(name: str, before_2_13: str) -> Any:
    """A functional collective by its name from torch 2.13 on (`*_single*`), or by its older name, which
    2.13 and later deprecate with a FutureWarning at every call (torch 2.11 has only the older one)."""
    return getattr(functional, name, None) or getattr(functional, before_2_13)


def all_gather_autograd(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Every rank's `t` of `group`, concatenated along `dim`, differentiable (the backward
    reduce-scatters): functional collectives' all_gather_single_autograd (context parallelism's K/V)."""
    return _functional("all_gather_single_autograd", "all_gather_tensor_autograd")(t, dim, group)


def all_gather_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's `t` of `group`, concatenated along dim 0 (functional all_gather; no autograd),
    waited for: a result dropped unwaited would leave the collective writing into freed memory."""
    return wait_tensor(_functional("all_gather_single", "all_gather_tensor")(t, 0, group))


def reduce_scatter_rows(t: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's 1/size of `t` along dim 0, summed over `group` (functional reduce_scatter; no
    autograd), waited for."""
    return wait_tensor(_functional("reduce_scatter_single", "reduce_scatter_tensor")(t, "sum", 0, group))


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `t` over `group`, as a new tensor (functional all_reduce; no autograd)."""
    return functional_all_reduce(t, "sum", group)


def cpu_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp of each query's scores) of SDPA's CPU flash kernel, [batch, heads, seq, dim]
    inputs (context parallelism merges pieces of one attention by their log-sum-exps)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=None, scale=scale
    )
    return out, lse


def cpu_flash_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU flash kernel's backward: (dq, dk, dv) given the whole attention's output and log-sum-exp."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale
    )
    return dq, dk, dv


def ring_attention(
    group: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's causal ring attention over `group` ([batch, heads, seq, dim]; chunks r and 2C-1-r of the line):
    each step attends to the keys and values passed on from the previous rank: (output, log-sum-exp)."""
    with _ring_options():
        out, lse, *_ = torch_cp._templated_ring_attention(
            group, 2, _ring_kernels(q)[0], q, k, v, is_causal=True, dropout_p=0.0, scale=scale
        )
    return out, lse


def ring_attention_backward(
    group: Any,
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: Optional[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `ring_attention`: keys and values go round again, their gradients back after them."""
    with _ring_options():
        dq, dk, dv, *_ = torch_cp._templated_ring_attention_backward(
            group,
            2,
            _ring_kernels(q)[1],
            grad_out=grad,
            grad_out_name="grad_out",
            query=q,
            key=k,
            value=v,
            out=out,
            logsumexp=lse,
            is_causal=True,
            dropout_p=0.0,
            scale=scale,
        )
    return dq, dk, dv


def group_named(name: str) -> Any:
    """The process group of this name (a custom op takes a group by its name, as functional collectives do)."""
    return _resolve_process_group(name)


@contextlib.contextmanager
def _ring_options() -> Iterator[None]:
    """torch's ring settings (process-wide, so restored after): keys and values sent to the next rank
    at each step (all-to-all; its default all-gathers them all at once), the round-robin load balance
    our chunks follow, merged in fp32."""
    options = torch_cp._cp_options
    saved = options.rotate_method, options.enable_load_balance, options.convert_to_f32
    options.rotate_method, options.enable_load_balance, options.convert_to_f32 = (
        torch_cp._RotateMethod.ALL_TO_ALL,
        True,
        True,
    )
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance, options.convert_to_f32 = saved


def _ring_kernels(q: torch.Tensor) -> tuple[Any, Any]:
    """(forward, backward) attention kernels of one ring step: the CPU flash kernel, which takes
    grouped-query keys and values as they are; CUDA's flash kernel, with each KV head repeated for its
    query heads and their gradients summed back."""
    if not q.is_cuda:
        aten = torch.ops.aten
        return (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    return _cuda_flash, _cuda_flash_backward


def _cuda_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> tuple[Any, ...]:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, **kwargs)
    return out, lse


def _cuda_flash_backward(
    *, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
) -> tuple[Any, ...]:
    """Dense lines without dropout: no cumulative lengths, and the RNG state is a placeholder, as the
    forward kernel itself returns it without dropout."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    unused = dict(
        cum_seq_q=None,
        cum_seq_k=None,
        max_q=query.shape[2],
        max_k=key.shape[2],
        philox_seed=query.new_empty(2, dtype=torch.uint64),
        philox_offset=query.new_empty((), dtype=torch.uint64),
    )
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward.default(
        query=query, key=key, value=value, **kwargs, **unused
    )
    if groups == 1:
        return dq, dk, dv
    return dq, *(g.unflatten(1, (-1, groups)).sum(2, dtype=torch.float32).to(g.dtype) for g in (dk, dv))


def flatten_mesh(mesh: Any, dims: tuple[str, ...], name: str) -> Any:
    """Mesh dimensions `dims` flattened into one named `name` on `mesh` (DeviceMesh._flatten, as
    torchtitan flattens shard x cp for FSDP): the same 1-D mesh at every call. Kept, not sliced from
    the root mesh by its name (`mesh[name]`), which torch deprecates with a warning."""
    return mesh[dims]._flatten(name)


def joined_meshes(*meshes: Any) -> Any:
    """Sub-meshes of one root mesh side by side, as one mesh (DeviceMesh._concatenate): a flattened
    dimension beside another without slicing it from the root by its name (deprecated)."""
    return DeviceMesh._concatenate(list(meshes))


def context_parallel_compiles() -> bool:
    """Whether context parallelism's attention trains right in compiled blocks: on torch 2.11 the
    compiled backward of its merged attention took wrong steps (the first loss right, the next ones not;
    measured, tests/test_meshes.py); 2.13 and 2.14 match eager. 2.12 is not measured and is refused too."""
    return TORCH >= (2, 13)


def v_shaped_schedules_run() -> bool:
    """Whether torch.distributed.pipelining's V-shaped schedules (ZBVZeroBubble, DualPipeV) run: on
    torch 2.11 both stopped at their first step with a gloo pair never connected (measured, 2 ranks);
    2.13 and 2.14 run them. 2.12 is not measured and is refused too."""
    return TORCH >= (2, 13)


def reusable_stager() -> bool:
    """Whether one DefaultStager stages every background save: torch 2.11 and 2.12 free its CPU buffers
    at the end of each stage and cannot stage with it again (its copier table is cleared: "KeyError:
    <class 'type'>"), so there each save takes a new one and allocates its buffers anew."""
    return TORCH >= (2, 13)


def quiet_http_transport(timeout: Any) -> Any:
    """torchft's HTTP checkpoint transport, its server's access-log lines sent to torchft's logger, not
    stderr (torchft 0.2's private server attribute: here, so that a release that moves it is found)."""
    from torchft.checkpointing import HTTPTransport

    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    handler = transport._server.RequestHandlerClass  # torchft 0.2's server; its class is made in __init__
    logger = logging.getLogger("torchft.checkpointing.http_transport")

    def log_message(self: Any, format: str, *args: Any) -> None:
        logger.info(format, *args)

    transport._server.RequestHandlerClass = type("QuietRequestHandler", (handler,), {"log_message": log_message})
    return transport


__all__ = [
    "OLDEST_TORCH",
    "TORCH",
    "all_gather_autograd",
    "all_reduce_sum",
    "check_torch",
    "context_parallel_compiles",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "cuda_memory_snapshot",
    "fake_store",
    "flatten_mesh",
    "flight_recorder_dump",
    "fsspec_storage",
    "group_members",
    "group_named",
    "joined_meshes",
    "local_box",
    "local_shape_and_offset_at",
    "loader_workers_died",
    "local_tensor",
    "matmul_and_attention_ops",
    "mem_tracker",
    "muon_adjusted_lr",
    "muon_orthogonalize",
    "quiet_http_transport",
    "record_cuda_memory_history",
    "reduce_scatter_op",
    "reusable_stager",
    "ring_attention",
    "ring_attention_backward",
    "set_group_timeout",
    "Shard",
    "ShardedTensor",
    "ShardedTensorMetadata",
    "ShardMetadata",
    "TensorProperties",
    "tree_map_only",
    "unwatch_loader_workers",
]
