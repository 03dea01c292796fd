"""--deterministic: the same command gives bit-identical losses and weights. Every seed is fixed
(Python's, numpy's and torch's; the weights' initialisation and the data's order already follow
--seed), torch runs its deterministic algorithms (an operation that has none stops the run in one
line naming it: train/step.py), cuDNN its deterministic kernels without autotuning, and cuBLAS a
fixed workspace. The package's own reductions (the loss, the gradient norm, the metrics) already run in a
fixed order over a fixed world. What cannot be made repeatable is refused at start-up (config.py):
--fault_tolerance, whose replica groups come and go with the timing of failures."""

from __future__ import annotations

import os
import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace (CUDA's documented setting)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's (every device's) random generators from `seed`."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextmanager
def deterministic(on: bool, seed: int) -> Iterator[None]:
    """For the block: with `on`, the seeds and torch's deterministic settings (set before the run's
    first CUDA kernel; put back after, so that a run called from Python leaves the process as it was)."""
    if not on:
        yield
        return
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    seed_everything(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
