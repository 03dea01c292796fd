"""The torch this package runs on: every private torch API it uses still stands where compat.py takes
it from (a release that moves one fails here, not in a run), no other module reaches into torch's
private modules, and the version facts compat.py acts on are right."""

import ast
import re

import pytest
import torch

from fms_fsdp import compat
from fms_fsdp.errors import ConfigError

from conftest import ROOT

pytestmark = pytest.mark.torch_api  # also run on the oldest and newest torch (scripts/test_torch.sh)


def test_every_private_torch_api_is_where_compat_takes_it_from():
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name
    fake_mode, mem_tracker, mod_state = compat.mem_tracker()
    assert callable(fake_mode) and callable(mem_tracker) and hasattr(mod_state, "POST_FW")
    reader, writer = compat.fsspec_storage()
    assert isinstance(compat.fake_store(), torch.distributed.Store)
    assert hasattr(reader, "read_metadata") and hasattr(writer, "write_data")
    local, offset = compat.local_shape_and_offset_at((8, 4), (2,), [1], [torch.distributed.tensor.Shard(0)])
    assert (tuple(local), tuple(offset)) == ((4, 4), (4, 0))
    ops = compat.matmul_and_attention_ops()
    assert torch.ops.aten.mm.default in ops
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ops


def test_no_other_module_reaches_into_torch_privately():
    """No `import torch._x`, `from torch.x._y import z`, `from torch import _x`, nor a `torch.x._y`
    attribute outside compat.py (dunder names are public)."""
    private = re.compile(r"(^|\.)_(?!_)")
    for path in (ROOT / "fms_fsdp").rglob("*.py"):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
            elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch."):
                names = [ast.unparse(node)]
            assert not any(private.search(n) for n in names), (path.name, node.lineno, names)
        assert "torch.ops.aten" not in path.read_text(), f"{path.name}: aten ops are compat.py's"


def test_the_torch_version_is_read_and_supported(monkeypatch):
    assert compat.TORCH == tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert compat.TORCH >= compat.OLDEST_TORCH
    compat.check_torch()
    monkeypatch.setattr(compat, "TORCH", (2, 8))  # as an older torch reads
    with pytest.raises(ConfigError, match=r"torch .* is older than 2.11, the oldest release .* 'torch>=2.11'"):
        compat.check_torch()
    floor = ".".join(map(str, compat.OLDEST_TORCH))
    assert f"torch>={floor}" in (ROOT / "requirements.txt").read_text()
    assert f'"torch>={floor}"' in (ROOT / "pyproject.toml").read_text()


def test_the_collectives_and_meshes_used_raise_no_deprecation_warning(one_process_group):
    """compat.py takes the functional collectives by their names of torch 2.13 on (the older names warn
    at every call there), and the FSDP mesh under context parallelism joins the flattened shard x cp
    dimension to 'replicate' without slicing it from the root by name (which warns on every rank)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from fms_fsdp.parallel.mesh import dp_mesh

    group = torch.distributed.group.WORLD
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = torch.arange(6.0, requires_grad=True)
        gathered = compat.all_gather_autograd(t, 0, group)
        (gathered * 2).backward(torch.ones(6))  # a contiguous gradient, as attention's
        assert torch.equal(gathered, t) and torch.equal(t.grad, torch.full((6,), 2.0))
        assert torch.equal(compat.all_gather_rows(t.detach(), group), t.detach())
        assert torch.equal(compat.reduce_scatter_rows(t.detach(), group), t.detach())
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("replicate", "shard", "cp"))
        dp = dp_mesh(mesh)
        assert dp.mesh_dim_names == ("replicate", "shard_cp") and dp.shape == (1, 1)
        assert dp.get_group(1) is compat.flatten_mesh(mesh, ("shard", "cp"), "shard_cp").get_group()
