"""The run's state on disk: checkpoints saved, kept and resumed, and the exports a run writes (the
weights' formats and readers are in weights/).

A save is written under a hidden temporary name and renamed, with a COMPLETE marker inside, only after
every rank has finished; old checkpoints are deleted only after a newer one is complete. The README's map
of the package lists each module (scripts/gen_docs.py makes it from the module docstrings).
"""
