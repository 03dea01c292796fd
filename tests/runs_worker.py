"""Test worker (started as main_training.py's ranks are): several training runs one after another in one
process group, each as `main_training.py <flags>` runs it (startup.facts, then train.train), so
that tests needing many short runs on the same ranks pay the interpreters' and the group's start-up
once. The group is the first run's (its device and collective timeout). $RUNS: a JSON list of each
run's flags."""

import json
import os

from fms_fsdp.flags import parse_args
from fms_fsdp.parallel.process_group import start_process_group, stop_process_group
from fms_fsdp.resilience.triggers import StopRequest
from fms_fsdp.startup import facts, with_mesh
from fms_fsdp.train.loop import train_run

# every run's flags before any process group; each run's facts just before it (a run may load what an
# earlier one wrote)
configs = [parse_args(flags) for flags in json.loads(os.environ["RUNS"])]
first = facts(configs[0])
start_process_group(first.device, first.cfg.collective_timeout_minutes)
stop = StopRequest()
try:
    for cfg in configs:
        train_run(with_mesh(facts(cfg)), stop)
finally:
    stop.restore()
    stop_process_group()
