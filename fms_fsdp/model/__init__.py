"""The model: variants, construction and FLOPs (variants.py), weight init (initialization.py), the chunked
loss (loss.py), mixtures of experts (moe.py), LoRA (lora.py), float8 (float8.py) and the sizes fms derives
from its config (shapes.py)."""
