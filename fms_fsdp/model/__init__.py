"""The model: variants, construction and FLOPs (variants.py), weight init (initialization.py), the chunked
loss (loss.py), LoRA (lora.py) and float8 (float8.py)."""
