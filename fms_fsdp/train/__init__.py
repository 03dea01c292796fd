"""The training loop: the loop (loop.py), one optimizer step (step.py), the step guard (guard.py), their
settings (settings.py) and --dry_run's rehearsal and plan (dry_run.py). The model is built by parallel/assemble.py; what keeps a run alive around the loop is
in resilience/."""
