"""The memory plan (--dry_run): what one rank will hold at its peak, predicted before any GPU is touched.
plan.py plans from the parameter shapes, the mesh and traced activations (activations.py); rehearsal.py
checks it against the shards of the start itself, rehearsed under a fake process group; report.py prints the
plan and what fits, and warns at start-up when a run's plan does not fit its device; settings.py holds the
flags it reads."""
