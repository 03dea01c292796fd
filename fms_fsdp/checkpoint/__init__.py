"""Checkpoints that never lose a run, one concern per module:

- layout.py   step folders under <ckpt_save_path>/checkpoints, discovery, atomic commit and deletion
- policy.py   which checkpoints are kept (--checkpoint_keep, --checkpoint_keep_policy)
- disk.py     the free-space guard run before each save
- checkpointer.py `Checkpointer`: the start of a run (resume, else --ckpt_load_path), resume
- save.py     its saving (`CheckpointSaver`): DCP save (sync or async), commit, failures agreed by
              every rank
- settings.py the flags of checkpoints and exports (`CheckpointSettings`, `ExportSettings`)
- weights.py  a model's weights from --ckpt_load_path (checkpoint folder, Hugging Face folder, file)
- writer.py   the background writer of async checkpoints and periodic exports
- fused.py    fms's fused keys for a model built unfused (tensor parallel)
- weights_reader.py reading weights outside training (folders, .safetensors, .pth), never running code
- items.py    a checkpoint folder's tensors read a run of rows at a time, from their byte ranges
- export.py   the whole model as one safetensors file or a Hugging Face folder, every rank its part
- hf.py       fms <-> Hugging Face LlamaForCausalLM folders; PEFT adapter folders
- hf_read.py  a Hugging Face folder read into a sharded model, each rank only its slices
- hf_write.py safetensors files planned from shapes and streamed 16 MB of rows at a time

A save is written under a hidden temporary name and renamed, with a COMPLETE marker inside, only after
every rank has finished; old checkpoints are deleted only after a newer one is complete.
"""
