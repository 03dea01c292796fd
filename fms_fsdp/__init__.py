"""Pretraining of ibm-fms LLaMA models with FSDP2 / HSDP."""

from fms_fsdp.config import train_config
from fms_fsdp.models import get_model_config

__all__ = ["train_config", "get_model_config"]
