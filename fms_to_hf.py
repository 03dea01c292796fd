"""Convert a checkpoint to a Hugging Face LlamaForCausalLM folder (the logic: fms_fsdp/weights/hf.py,
behind fms_fsdp/cli.py; installed as `fms-to-hf`).

    python fms_to_hf.py --load_path=<ckpt_save_path>/checkpoints/step_N_ckp --save_path=out \
        [--model_variant=llama3_8b] [--tokenizer_name_or_path=local_tokenizer_dir] [--dtype=bf16|fp32]
"""

from fms_fsdp.cli import to_hf

if __name__ == "__main__":
    to_hf()
