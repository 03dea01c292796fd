"""Test worker (run under torchrun): builds the model as training does, once per case, and writes
<ckpt_save_path>/rank<N>.<case>.json with this rank's shard sizes; with $INSPECT_WEIGHTS=1 a
fingerprint of the full weights and the loss on the first batch, and with $INSPECT_BACKWARD=1 too
whether a non-last micro-batch's gradients were reduce-scattered. argv: the flags every case shares; $INSPECT_CASES: a JSON list of
each case's extra flags (default: one case without extras). Peak RSS around the first build is
recorded too (measure memory with one case: later builds start from a higher peak)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fms_fsdp.data import get_data_loader
from fms_fsdp.flags import parse_args
from fms_fsdp.parallel.parallelize import set_gradient_sync
from fms_fsdp.parallel.process_group import start_process_group, stop_process_group
from fms_fsdp.startup import facts, sharded_model, with_mesh


def peak_rss_mb() -> float:
    """This process's peak resident memory since its exec (VmHWM; getrusage's ru_maxrss would count the
    parent's memory at fork too)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def inspect(cfg) -> dict:
    run = with_mesh(facts(cfg))
    rank, world_size = run.info.rank, run.info.world_size
    rss_before_mb = peak_rss_mb()
    model = sharded_model(run)
    peak_after_mb = peak_rss_mb()  # before anything below gathers
    params = list(model.parameters())
    record = {
        "rank": rank,
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "full_numel": sum(p.numel() for p in params),  # a DTensor's numel is the full parameter's
        "all_dtensor": all(isinstance(p, DTensor) for p in params),
        "mesh": list(params[0].device_mesh.shape) if isinstance(params[0], DTensor) else None,
        "peak_rss_before_build_mb": rss_before_mb,
        "peak_rss_after_build_mb": peak_after_mb,
    }
    if os.environ.get("INSPECT_WEIGHTS") == "1":
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
        record["weight_fingerprint"] = {
            n: [t.double().sum().item(), t.double().square().sum().item()] for n, t in full.items()
        }
        inputs, labels = next(iter(get_data_loader(run.settings.data, rank, world_size)))
        with torch.no_grad():
            loss = model(inputs, labels=labels)
        dist.all_reduce(loss)
        record["initial_loss"] = loss.item() / world_size
        if os.environ.get("INSPECT_BACKWARD") == "1":
            # the first micro-batch of an accumulating step: are its gradients already in the sharded .grad?
            set_gradient_sync(model, last_micro_batch=False)
            model(inputs, labels=labels).backward()
            record["reduced_per_micro_batch"] = all(p.grad is not None for p in params)
    return record


common = sys.argv[1:]
cases = json.loads(os.environ.get("INSPECT_CASES", "[[]]"))
first = facts(parse_args(common))
start_process_group(first.device)
out = Path(first.cfg.ckpt_save_path)
out.mkdir(parents=True, exist_ok=True)
for k, extra in enumerate(cases):
    record = inspect(parse_args([*common, *extra]))
    (out / f"rank{first.info.rank}.{k}.json").write_text(json.dumps(record))
dist.barrier()
stop_process_group()
