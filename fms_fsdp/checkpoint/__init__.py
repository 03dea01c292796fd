"""Checkpoints that never lose a run, one concern per module:

- layout.py   step folders under <ckpt_save_path>/checkpoints, discovery, atomic commit and deletion
- policy.py   which checkpoints are kept (--checkpoint_keep, --checkpoint_keep_policy)
- disk.py     the free-space guard run before each save
- io.py       `Checkpointer`: DCP save (sync or async), resume, --ckpt_load_path
- reader.py   reading weights outside training (folders, .safetensors, .pth), never running code
- export.py   the whole model as one safetensors file

A save is written under a hidden temporary name and renamed, with a COMPLETE marker inside, only after
every rank has finished; old checkpoints are deleted only after a newer one is complete.
"""
