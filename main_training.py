"""Pretrain an ibm-fms LLaMA: torchrun --nproc_per_node=N main_training.py --model_variant=... --flag=value"""

from fms_fsdp.train import main

if __name__ == "__main__":
    main()
