"""Which complete checkpoints survive: the latest --checkpoint_keep, plus those kept for good by
--checkpoint_keep_policy, e.g. 'every 1000 until 10000, then every 5000' (Levanter's keep list), plus
the --checkpoint_keep_best best by --checkpoint_monitor (HyperPod's save_top_k and monitor)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

from fms_fsdp.errors import ConfigError

_POLICY_PART = re.compile(r"^every (\d+)(?: until (\d+))?$")


# metrics where lower is better (a loss, a perplexity, lm-eval's bits per byte); higher for any other
LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "bits_per_byte")


@dataclass(frozen=True)
class KeepPolicy:
    """The latest `latest` checkpoints, plus permanent ones by step (rules of (every, until)), plus the
    `best` best by the evaluation metric `monitor` (lower is better for a loss or a perplexity, higher
    for anything else; a tie goes to the earlier step)."""

    latest: int
    rules: tuple[tuple[int, Optional[int]], ...] = ()
    best: int = 0
    monitor: str = "eval_loss"

    @classmethod
    def parse(cls, latest: int, text: str, best: int = 0, monitor: str = "eval_loss") -> "KeepPolicy":
        """The policy of --checkpoint_keep and --checkpoint_keep_policy; ConfigError naming the part it cannot read."""
        rules = []
        for part in filter(None, (p.strip().removeprefix("then ").strip() for p in text.split(","))):
            m = _POLICY_PART.match(part)
            if not m or int(m.group(1)) < 1:
                raise ConfigError(
                    f"--checkpoint_keep_policy: cannot read {part!r}; write e.g. "
                    "'every 1000 until 10000, then every 5000'"
                )
            rules.append((int(m.group(1)), int(m.group(2)) if m.group(2) else None))
        return cls(latest, tuple(rules), best, monitor)

    def permanent(self, step: int) -> bool:
        start = 0
        for every, until in self.rules:
            if until is None or step <= until:
                return step > start and step % every == 0
            start = until
        return False

    def best_of(self, steps: list[int], scores: Mapping[int, float]) -> set[int]:
        """The `best` steps among `steps` by their scores (steps without one are not ranked)."""
        sign = 1.0 if any(name in self.monitor for name in LOWER_IS_BETTER) else -1.0
        ranked = sorted((s for s in steps if s in scores), key=lambda s: (sign * scores[s], s))
        return set(ranked[: self.best])

    def to_delete(self, steps: list[int], scores: Mapping[int, float] = {}) -> list[int]:
        """Steps of complete checkpoints to delete (never the newest); `scores`: the monitored metric
        by step, where it was measured."""
        ordered = sorted(steps)
        keep = set(ordered[-max(1, self.latest) :]) | {s for s in ordered if self.permanent(s)}
        keep |= self.best_of(ordered, scores)
        return [s for s in ordered if s not in keep]
