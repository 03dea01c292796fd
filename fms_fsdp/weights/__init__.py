"""The model's weights in and out of other formats: Hugging Face folders read and written, checkpoint
folders and weight files read outside a run, a run's first weights loaded from --ckpt_load_path, and
fms's fused keys.

The README's map of the package lists each module (scripts/gen_docs.py makes it from the module
docstrings).
"""
