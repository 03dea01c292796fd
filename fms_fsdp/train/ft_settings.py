"""The settings of --fault_tolerance (train/ft.py) and its start-up checks: the flags with torchft's and
torchx's environment filled in, torchft installed, FSDP inside each replica group, no pipeline; the wait
for a lighthouse that answers (run.started); and the fingerprint of what every replica group must share
(the model, the mesh and SHARED_FLAGS), which train/ft.py compares across the live groups at each step.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from fms_fsdp.config import train_config
from fms_fsdp.errors import ConfigError
from fms_fsdp.parallel.mesh import MeshShape


@dataclass(frozen=True)
class FTSettings:
    """--fault_tolerance's flags, the environment filled in (torchft's and torchx's variables)."""

    groups: int
    index: int
    lighthouse: str  # http://host:port
    min_replicas: int
    timeout: timedelta
    step_timeout: float  # seconds; 0: no watchdog

    @staticmethod
    def of(cfg: train_config) -> Optional["FTSettings"]:
        """None without --fault_tolerance; ConfigError naming the flag when one is missing or wrong."""
        if not cfg.fault_tolerance:
            return None
        groups = _flag_or_env(cfg.ft_replica_groups, "ft_replica_groups", "NUM_REPLICA_GROUPS")
        index = _flag_or_env(cfg.ft_group_index, "ft_group_index", "REPLICA_GROUP_ID")
        if index >= groups:
            raise ConfigError(f"--ft_group_index={index} must be below --ft_replica_groups={groups}")
        if cfg.ft_min_replicas > groups:
            raise ConfigError(
                f"--ft_min_replicas={cfg.ft_min_replicas} is more than the {groups} replica groups "
                "(--ft_replica_groups): no step could ever commit"
            )
        lighthouse = cfg.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ConfigError(
                "--fault_tolerance needs the lighthouse: --ft_lighthouse=host:port or $TORCHFT_LIGHTHOUSE"
            )
        if "://" not in lighthouse:
            lighthouse = "http://" + lighthouse
        port = lighthouse.rstrip("/").rpartition(":")[2]
        if not port.isdigit():
            raise ConfigError(f"--ft_lighthouse={lighthouse}: expected host:port (such as head-node:29510)")
        return FTSettings(
            groups,
            index,
            lighthouse,
            cfg.ft_min_replicas,
            timedelta(seconds=cfg.ft_timeout_seconds),
            cfg.ft_step_timeout_seconds,
        )


# Flags every replica group must share beyond the model and the mesh: the fields marked `shared` in
# config.py (what sets each group's batches and every update: data layout and order, optimizer,
# learning-rate schedule, precision, adapters). Paths (the data's too: a copy on another mount),
# logging and checkpoint cadence may differ.
SHARED_FLAGS = tuple(f.name for f in dataclasses.fields(train_config) if f.metadata["shared"])


def fingerprint(cfg: train_config, model_config: Any, shape: MeshShape) -> str:
    """What every replica group must share: the model, the mesh and SHARED_FLAGS."""
    return "|".join([str(model_config), str(shape), *(f"{f}={getattr(cfg, f)!r}" for f in SHARED_FLAGS)])


def _flag_or_env(value: Optional[int], flag: str, env: str) -> int:
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is None or not text.isdigit():
        raise ConfigError(f"--fault_tolerance needs --{flag} (or ${env})" + (f"; ${env}={text!r}" if text else ""))
    return int(text)


def check_fault_tolerance(cfg: train_config, shape: MeshShape, world_size: int) -> Optional[FTSettings]:
    """The settings of --fault_tolerance (None without it), after its start-up checks: torchft
    installed, FSDP inside the group, no pipeline. It does not wait: run.started waits for the
    lighthouse (wait_for_lighthouse)."""
    settings = FTSettings.of(cfg)
    if settings is None or cfg.dry_run:
        return settings
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("--fault_tolerance needs torchft: pip install 'torchft==0.2.0' (extra ft)") from None
    if shape.pp > 1:
        raise ConfigError("--fault_tolerance does not run with --pipeline_parallel_size > 1 yet")
    if shape.replicate > 1 or world_size < 2 or cfg.sharding_strategy == "ddp":
        raise ConfigError(
            "--fault_tolerance replicates across groups: each group shards with FSDP over its own ranks "
            f"(at least 2; this group has {world_size}, mesh {dict(shape.dims())}): "
            "use --sharding_strategy=fsdp, and one group per node or more"
        )
    return settings


def wait_for_lighthouse(settings: FTSettings) -> None:
    """Wait up to --ft_timeout_seconds for the lighthouse to answer (the launcher may be starting it):
    ConfigError when nothing does."""
    address, seconds = settings.lighthouse, settings.timeout.total_seconds()
    host, _, port = address.split("://", 1)[1].rstrip("/").rpartition(":")
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"--ft_lighthouse={address}: nothing answers there after {seconds:g} s ({type(e).__name__}); "
                    "start it with `torchft_lighthouse --min_replicas 1 --bind [::]:PORT` "
                    "(scripts/train_ft.sh does)"
                ) from None
        time.sleep(0.5)
