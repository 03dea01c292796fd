"""Pretrain an ibm-fms LLaMA: torchrun --nproc_per_node=N main_training.py --model_variant=... --flag=value
(the entry point: fms_fsdp/cli.py's train; installed as `fms-train`)."""

from fms_fsdp.cli import train

if __name__ == "__main__":
    train()
