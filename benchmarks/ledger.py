"""The ledger's cost (fms-inspect-data --ledger, data/consumed.py) at 1,024 logical shards.

    python benchmarks/ledger.py [--data_path=/tmp/bench_data] [--ranks=8] [--batches=40] [--seq_length=4096]
        [--files=1000]

The ledger is worked out from the data positions every checkpoint already holds, so a checkpoint and a
step carry nothing more for it: this prints the loader state a checkpoint keeps per rank (its bytes, as
pickled), and what working the ledger out costs afterwards: the seconds to read `--ranks` ranks' states
after `--batches` batches each and name every document they consumed, on the synthetic Arrow dataset of
benchmarks/dataloader.py (`--files` files of 50 documents: 50M tokens in the 1,000 of the default).
"""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from dataloader import write_data  # noqa: E402

from fms_fsdp.cli import tool  # noqa: E402
from fms_fsdp.data import get_data_loader  # noqa: E402
from fms_fsdp.data.consumed import ledger_of  # noqa: E402
from fms_fsdp.flags import make_config  # noqa: E402
from fms_fsdp.startup import facts  # noqa: E402


def main(
    data_path: str = "/tmp/bench_data", ranks: int = 8, batches: int = 40, seq_length: int = 4096, files: int = 1000
) -> None:
    root = Path(data_path)
    if not (root / "bench").exists():
        write_data(root, files, 50, 32000, "arrow")
    cfg = make_config(
        data_path=str(root),
        datasets=["bench"],
        model_variant="llama2_7b",
        seq_length=seq_length,
        batch_size=2,
        num_workers=0,
        logical_shards=1024,
        ckpt_save_path=str(root.with_name(root.name + ".run")),
    )
    settings = facts(cfg).settings.data
    states, loader = [], None
    for rank in range(ranks):
        loader = get_data_loader(settings, rank, ranks)
        it = iter(loader)
        for _ in range(batches):
            next(it)
        states.append(pickle.loads(pickle.dumps(loader.state_dict())))
    assert loader is not None
    state_bytes = max(len(pickle.dumps(s)) for s in states)
    start = time.perf_counter()
    (ledger,) = ledger_of(states, loader.datasets, loader.seed, loader.logical_shards, loader.packing)
    seconds = time.perf_counter() - start
    print(
        f"logical_shards=1024 ranks={ranks} batches_per_rank={batches} tokens_read={ledger.framed:,} "
        f"documents_seen={int(np.count_nonzero(ledger.seen)):,}/{ledger.documents:,} "
        f"state_bytes_per_rank={state_bytes:,} "
        f"ledger_seconds={seconds:.2f}"
    )


if __name__ == "__main__":
    tool(main)
