"""Bad steps, judged on the device: a non-finite loss or gradient norm stops the run; with
--skip_bad_steps=N a step whose global gradient norm is not finite, or spikes more than --spike_sigma
standard deviations above the mean of the last SPIKE_WINDOW kept steps, is left out of the update
(Levanter's and OLMo's policy), up to N in a row, then the run stops.

Nothing here waits for the device: the fused AdamW kernel skips a step through its `found_inf` input,
as under a GradScaler, and the host reads the verdict only at report, checkpoint and stop steps
(`check`), before anything is reported or saved. The gradient norm is global, so every rank skips
the same steps.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fms_fsdp.errors import TrainingError

SPIKE_WINDOW = 128  # kept steps whose norms make the mean and deviation
SPIKE_MIN_HISTORY = 20  # no spike is called before this many kept steps
_NONE = 2**62


class StepGuard:
    """Judges each step after its gradients are clipped and before the optimizer applies them."""

    def __init__(
        self, skip_bad_steps: int, spike_sigma: Optional[float], optimizer: torch.optim.Optimizer, device: torch.device
    ):
        self.limit, self.sigma = skip_bad_steps, spike_sigma
        self.optimizer = optimizer
        self.first_stop = torch.full((), _NONE, dtype=torch.int64, device=device)
        self.in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # since the last report
        self.norms = torch.zeros(SPIKE_WINDOW, device=device)  # the last kept norms, a ring
        self.kept_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.kept: Optional[torch.Tensor] = None  # whether the last step was applied

    @property
    def skipping(self) -> bool:
        return self.limit > 0

    def judge(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """Note whether `step` is bad; when skipping, tell the optimizer to leave it out (and every
        step after the run must stop). `norm` must be the global gradient norm when skipping."""
        if not self.skipping:
            bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
            self.first_stop = torch.minimum(self.first_stop, torch.where(bad, step, _NONE))
            return
        norm = norm.detach().float()
        bad = ~torch.isfinite(norm) | self._spike(norm)
        self.in_a_row = torch.where(bad, self.in_a_row + 1, 0)
        self.first_stop = torch.minimum(self.first_stop, torch.where(self.in_a_row > self.limit, step, _NONE))
        skip = bad | (self.first_stop != _NONE)
        self.skipped += skip
        self.kept = ~skip
        slot = (self.kept_steps % SPIKE_WINDOW).view(1)
        self.norms.index_copy_(0, slot, torch.where(skip, self.norms.index_select(0, slot), norm.view(1)))
        self.kept_steps += self.kept
        self.optimizer.found_inf = skip.float()

    def _spike(self, norm: torch.Tensor) -> torch.Tensor:
        if self.sigma is None:
            return torch.zeros((), dtype=torch.bool, device=norm.device)
        n = self.kept_steps.clamp(max=SPIKE_WINDOW)
        valid = torch.arange(SPIKE_WINDOW, device=norm.device) < n
        mean = torch.where(valid, self.norms, 0).sum() / n.clamp(min=1)
        var = torch.where(valid, (self.norms - mean) ** 2, 0).sum() / (n - 1).clamp(min=1)
        return (n >= SPIKE_MIN_HISTORY) & (norm > mean + self.sigma * var.sqrt())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What spike detection has seen (copies): a replica group that catches up takes the others' (resilience/ft.py),
        so that every group skips the same steps."""
        return {"norms": self.norms.clone(), "kept_steps": self.kept_steps.clone(), "in_a_row": self.in_a_row.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.norms.copy_(state["norms"])
        self.kept_steps.copy_(state["kept_steps"])
        self.in_a_row = state["in_a_row"].to(self.in_a_row.device)

    def skipped_since_report(self) -> int:
        """Steps left out since the last call (reads the device: call at report steps)."""
        count = int(self.skipped)
        self.skipped.zero_()
        return count

    def check(self) -> None:
        """TrainingError on every rank when any rank must stop. Every rank must call it."""
        first = self.first_stop.clone()
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        if int(first) == _NONE:
            return
        what = (
            "the loss or gradient norm is not finite"
            if not self.skipping
            else (
                f"{self.limit + 1} bad steps in a row (gradient norm not finite"
                + ("" if self.sigma is None else f" or over {self.sigma:g} sigma above its recent mean")
                + f"; --skip_bad_steps={self.limit})"
            )
        )
        raise TrainingError(
            f"step {int(first)}: {what}; lower --learning_rate, check the data, or resume from an earlier checkpoint"
        )
