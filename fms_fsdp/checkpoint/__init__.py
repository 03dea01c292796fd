"""The run's state on disk and the model's weights in and out: checkpoints saved, kept and resumed, exports, and
Hugging Face folders read and written.

A save is written under a hidden temporary name and renamed, with a COMPLETE marker inside, only after
every rank has finished; old checkpoints are deleted only after a newer one is complete. The README's map
of the package lists each module (scripts/gen_docs.py makes it from the module docstrings).
"""
