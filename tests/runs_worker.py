"""Test worker (started as main_training.py's ranks are): several training runs one after another in one
process group, each as `main_training.py <flags>` runs it (train.check_config, then train.train), so
that tests needing many short runs on the same ranks pay the interpreters' and the group's start-up
once. The group is the first run's (its device and collective timeout). $RUNS: a JSON list of each
run's flags."""

import json
import os

import torch.distributed as dist

from fms_fsdp.config import parse_args
from fms_fsdp.distributed import init_distributed
from fms_fsdp.train import check_config, train

configs = [parse_args(flags) for flags in json.loads(os.environ["RUNS"])]
for cfg in configs:  # every run's flags before any process group, as run() checks them
    check_config(cfg)
info = init_distributed(configs[0].device, configs[0].collective_timeout_minutes)
try:
    for cfg in configs:
        train(cfg, info)
finally:
    dist.destroy_process_group()
