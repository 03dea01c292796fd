"""The settings of --fault_tolerance (resilience/ft.py) and its start-up checks: the flags with torchft's and
torchx's environment filled in (built once, in settings.py), torchft installed, FSDP inside each replica
group, no pipeline; the wait for a lighthouse that answers (startup.started); and the fingerprint of what
every replica group must share (the model, the mesh and the flags config.py marks `shared`), which
resilience/ft.py compares across the live groups at each step.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

from fms_fsdp.errors import ConfigError
from fms_fsdp.parallel.settings import MeshShape


@dataclass(frozen=True, kw_only=True)
class FTSettings:
    """--fault_tolerance's flags, the environment filled in (torchft's and torchx's variables)."""

    groups: int
    index: int
    lighthouse: str  # http://host:port
    min_replicas: int
    timeout: timedelta
    step_timeout: float  # seconds; 0: no watchdog
    shared: str  # the values of the flags every replica group must share (the fingerprint's)

    @staticmethod
    def of(
        *,
        replica_groups: Optional[int],
        group_index: Optional[int],
        min_replicas: int,
        lighthouse: Optional[str],
        timeout_seconds: float,
        step_timeout: float,
        shared: str,
    ) -> "FTSettings":
        """The flags --ft_*, torchft's and torchx's environment filling those not given; ConfigError
        naming the flag when one is missing or wrong."""
        groups = _flag_or_env(replica_groups, "ft_replica_groups", "NUM_REPLICA_GROUPS")
        index = _flag_or_env(group_index, "ft_group_index", "REPLICA_GROUP_ID")
        if index >= groups:
            raise ConfigError(f"--ft_group_index={index} must be below --ft_replica_groups={groups}")
        if min_replicas > groups:
            raise ConfigError(
                f"--ft_min_replicas={min_replicas} is more than the {groups} replica groups "
                "(--ft_replica_groups): no step could ever commit"
            )
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
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
            groups=groups,
            index=index,
            lighthouse=lighthouse,
            min_replicas=min_replicas,
            timeout=timedelta(seconds=timeout_seconds),
            step_timeout=step_timeout,
            shared=shared,
        )


def fingerprint(shared: str, model_config: Any, shape: MeshShape) -> str:
    """What every replica group must share: the model, the mesh and the shared flags' values (`shared`:
    settings.shared_of)."""
    return "|".join([str(model_config), str(shape), shared])


def _flag_or_env(value: Optional[int], flag: str, env: str) -> int:
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is None or not text.isdigit():
        raise ConfigError(f"--fault_tolerance needs --{flag} (or ${env})" + (f"; ${env}={text!r}" if text else ""))
    return int(text)


def check_fault_tolerance(shape: MeshShape, world_size: int, sharding_strategy: str) -> None:
    """--fault_tolerance's start-up checks: torchft installed, FSDP inside the group, no pipeline. It
    does not wait: startup.started waits for the lighthouse (wait_for_lighthouse)."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ConfigError("--fault_tolerance needs torchft: pip install 'torchft==0.2.0' (extra ft)") from None
    if shape.pp > 1:
        raise ConfigError(
            "--fault_tolerance does not run with --pipeline_parallel_size > 1 yet: drop one of them (without "
            "--fault_tolerance a lost rank restarts the job from its last checkpoint)"
        )
    if shape.replicate > 1 or world_size < 2 or sharding_strategy == "ddp":
        raise ConfigError(
            "--fault_tolerance replicates across groups: each group shards with FSDP over its own ranks "
            f"(at least 2; this group has {world_size}, mesh {dict(shape.dims())}): "
            "use --sharding_strategy=fsdp, and one group per node or more"
        )


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
