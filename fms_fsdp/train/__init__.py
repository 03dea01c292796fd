"""The training loop: its model and optimizer built (make_model.py), the loop (loop.py), one optimizer step
(step.py), the step guard (guard.py), their settings (settings.py) and --dry_run's rehearsal
(rehearsal.py). What keeps a run alive around it is in resilience/."""
