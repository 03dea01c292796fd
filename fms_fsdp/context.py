"""The run's context: where it writes (`Paths`) and the facts worked out once at start-up (`Run`: the
flags, every component's settings, this process's place, the mesh, the model config), held by the
training loop, which hands each component the parts it uses. It imports no component: start-up
(startup.py) builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from fms_fsdp.config import to_dict
from fms_fsdp.storage import is_remote, location

if TYPE_CHECKING:
    import torch
    from fms.models.llama import LLaMAConfig
    from torch.distributed.device_mesh import DeviceMesh

    from fms_fsdp.config import train_config
    from fms_fsdp.parallel.pipeline import PipelinePlan
    from fms_fsdp.parallel.process_group import DistInfo
    from fms_fsdp.parallel.settings import MeshShape
    from fms_fsdp.resilience.ft_settings import FTSettings
    from fms_fsdp.settings import Settings


@dataclass(frozen=True)
class Paths:
    """<ckpt_save_path> (a local Path or an object-storage UPath) and what a run writes there."""

    root: Path

    @staticmethod
    def of(ckpt_save_path: str, ft_group: Optional[int] = None) -> "Paths":
        """--ckpt_save_path, or under --fault_tolerance its group_<i> folder: each replica group is a run
        of its own there (lease, checkpoints, metrics)."""
        root = location(ckpt_save_path, "ckpt_save_path")
        return Paths(root if ft_group is None else root / f"group_{ft_group}")

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def exports(self) -> Path:
        return self.root / "exports"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def diagnostics(self) -> Path:
        """What a hang leaves (resilience/hangs.py)."""
        return self.root / "diagnostics"

    @property
    def torchft_log(self) -> Optional[Path]:
        """torchft's own log lines under --fault_tolerance (None in object storage)."""
        return None if is_remote(self.root) else self.root / "torchft.log"

    @property
    def nccl_traces(self) -> Optional[str]:
        """The file-name prefix of NCCL's own Flight Recorder dumps at a timeout, rank appended (None
        in object storage, where torch cannot write)."""
        return None if is_remote(self.root) else f"{self.diagnostics / 'nccl'}/rank_"

    def model_file(self, step: int) -> Path:
        """--export_model_at_end's file."""
        return self.root / f"model_step_{step}.safetensors"


class StartLog:
    """Rank 0's lines while a training run starts: held (`lines` is a list) until it has started, then
    printed before its summary, so that a start that fails says its error and nothing before it."""

    def __init__(self) -> None:
        self.lines: Optional[list[str]] = None


@dataclass(frozen=True)
class Run:
    """The facts of one run, the same for every module."""

    cfg: train_config
    settings: Settings  # every component's settings, built from cfg once (fms_fsdp/settings.py)
    info: DistInfo
    shape: MeshShape
    model_config: LLaMAConfig
    notes: tuple[str, ...] = ()  # start-up notes for rank 0's log (how raw text is framed)
    mesh: Optional[DeviceMesh] = None  # once the process group is up (`started`)
    pipeline: Optional[PipelinePlan] = None  # --pipeline_parallel_size > 1
    ft: Optional[FTSettings] = None  # --fault_tolerance
    start_log: StartLog = field(default_factory=StartLog, compare=False)  # shared by the run's copies

    @cached_property
    def paths(self) -> Paths:
        """Resolved at first use: a dry run or an evaluation, which write nothing there, need no
        object-storage package for an s3:// --ckpt_save_path."""
        return Paths.of(self.cfg.ckpt_save_path, None if self.ft is None else self.ft.index)

    @property
    def variant(self) -> str:
        """--model_variant."""
        return self.cfg.model_variant

    @property
    def flags(self) -> dict[str, Any]:
        """The run's flags as a plain dict (each checkpoint's metadata.pth records them)."""
        return to_dict(self.cfg)

    @property
    def vocab_size(self) -> int:
        return self.model_config.src_vocab_size

    @property
    def device(self) -> torch.device:
        return self.info.device

    def log(self, message: str) -> None:
        """Print `message` on rank 0 only (while the run starts, into its held lines: `hold_log`)."""
        if not self.info.is_main:
            return
        if self.start_log.lines is not None:
            self.start_log.lines.append(message)
        else:
            print(message, flush=True)

    def hold_log(self) -> None:
        """Hold rank 0's lines until `release_log` (a training run's start)."""
        self.start_log.lines = []

    def release_log(self, tail: list[str]) -> None:
        """The run has started: print the held lines, then `tail`; later lines print at once."""
        held, self.start_log.lines = self.start_log.lines or [], None
        for line in [*held, *tail]:
            self.log(line)
