"""The training loop and what serves it: building its parts (build.py), the loop (loop.py), the step
guard (train/guard.py), stop and save triggers (train/triggers.py), the run lease (train/lease.py), fault-tolerant
replica groups (train/ft.py, train/ft_settings.py) and the periodic work it runs (train/periodic.py)."""
