"""The training loop: the loop (loop.py), one optimizer step (step.py), the step guard (guard.py) and their
settings (settings.py). The model is built by parallel/assemble.py; what keeps a run alive around the loop is
in resilience/."""
