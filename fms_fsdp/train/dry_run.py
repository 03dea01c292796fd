"""--dry_run: the start rehearsed at the planned size under a fake process group, and the memory plan."""

from __future__ import annotations

import time

from fms_fsdp.context import Run
from fms_fsdp.memory.rehearsal import rehearse, rehearsed_ranks
from fms_fsdp.memory.report import report as memory_report
from fms_fsdp.startup import model_build


def dry_run(run: Run) -> bool:
    """--dry_run of the run's facts: rank 0 rehearses the start at the planned size under a fake process
    group (memory/rehearsal.py) and prints the memory plan, its state from the rehearsal's real shards; no
    real process group starts, no GPU memory is touched. Whether the plan fits (other ranks: True)."""
    if not run.info.is_main:
        return True
    start = time.perf_counter()
    states = rehearse(model_build(run), optimizer=run.settings.optimizer, world_size=run.info.world_size, log=run.log)
    dims, ranks = run.shape.dims(), rehearsed_ranks(run.shape, run.info.world_size)
    which = f"ranks {', '.join(map(str, ranks))} (one per pipeline rank)" if len(ranks) > 1 else "rank 0"
    run.log(
        f"rehearsed the start of {run.info.world_size} ranks under a fake process group, mesh "
        f"({', '.join(name for name, _ in dims)}) = {tuple(size for _, size in dims)}: {which} parallelised "
        f"as at a real start in {time.perf_counter() - start:.1f} s"
    )
    plan = memory_report(
        run.settings.memory, run.shape, run.model_config, run.pipeline, run.info.local_world_size, states
    )
    run.log(plan.text)
    return plan.fits
