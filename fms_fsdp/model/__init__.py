"""The model: variants, construction, init and FLOPs (variants.py), attention with document masks and
context parallelism (model/attention.py), the chunked loss (model/loss.py), LoRA (model/lora.py) and float8 (model/float8.py)."""
