"""Evaluation on held-out data (--eval_data_path): every --eval_interval steps and at the end of a
training run, or of any model file or folder (`evaluate_once`: `fms-evaluate`, cli.py).

Each eval dataset's documents are read in file order, framed as in training ([bos] document eos,
[bol] ... [eol] per line) and cut into lines of seq_length + 1 tokens, the last one padded and masked;
--eval_batches limits them to the first eval_batches x eval_batch_size lines. Rank r takes lines r,
r + W, ...; every rank runs as many forward passes as the busiest (an idle rank's are masked), the
summed token losses and token counts are all-reduced, so the result depends on neither the world size
nor the batch size. Evaluation reads nothing from the training loader and draws no random numbers: a
run trains the same with or without it.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from fms_fsdp.data.shards import Dataset, dataset_sources, scan
from fms_fsdp.data.stream import Packing, strip_ends
from fms_fsdp.errors import ConfigError, DataError
from fms_fsdp.evaluation.harness import HarnessEvaluator
from fms_fsdp.evaluation.settings import CheckpointEvalSettings, EvalSettings
from fms_fsdp.model.loss import IGNORE_INDEX
from fms_fsdp.parallel.pipeline import Pipeline
from fms_fsdp.parallel.process_group import DistInfo, on_rank0
from fms_fsdp.periodic import Report
from fms_fsdp.storage import location
from fms_fsdp.weights.ema import WeightAverage

_PAD = -1  # marks the padding of the last line


def _documents(ds: Dataset, strip: frozenset[int]) -> Iterator[np.ndarray]:
    """The dataset's non-empty documents in file order, stripped as training strips them."""
    for file, entry in enumerate(ds.entries):
        for j in range(entry.documents):
            doc = strip_ends(ds.read(file, j), strip)
            if len(doc):
                yield doc


def eval_lines(ds: Dataset, packing: Packing, limit: Optional[int]) -> np.ndarray:
    """[n, seq_length + 1] int64 lines of the dataset, in order (at most `limit`); padding is _PAD."""
    body = packing.seq_length + 1 - int(packing.bol is not None) - int(packing.eol is not None)
    pieces, tokens = [], 0
    for doc in _documents(ds, packing.strip):
        framed = [doc.astype(np.int64), np.array([packing.eos], np.int64)]
        if packing.bos is not None:
            framed.insert(0, np.array([packing.bos], np.int64))
        pieces += framed
        tokens += sum(len(p) for p in framed)
        if limit is not None and tokens >= limit * body:
            break
    if not pieces:
        raise DataError(f"--eval_data_path: {ds.root / ds.name} has no document to evaluate", every_rank=True)
    stream = np.concatenate(pieces)
    if int(stream.max()) >= packing.vocab_size:
        raise DataError(
            f"--eval_data_path: {ds.root / ds.name} holds token id {int(stream.max())}, not below the "
            f"vocabulary size {packing.vocab_size}",
            every_rank=True,
        )
    n = -(-len(stream) // body)
    lines: np.ndarray = np.full((n, body), _PAD, np.int64)
    lines.reshape(-1)[: len(stream)] = stream
    if packing.bol is not None:
        lines = np.concatenate([np.full((n, 1), packing.bol, np.int64), lines], axis=1)
    if packing.eol is not None:
        lines = np.concatenate([lines, np.full((n, 1), packing.eol, np.int64)], axis=1)
    return lines[:limit]


class Evaluator:
    """The eval datasets of --eval_data_path, held as this rank's share of their lines; periodic work
    of the loop (periodic.Periodic) every --eval_interval steps and at the last."""

    reads_model = True

    def __init__(self, settings: EvalSettings, info: DistInfo):
        """Counts and indexes are cached where `settings.layout` says (startup.facts: a training run's data
        cache when --data_cache_dir is not given; `fms-evaluate` caches nothing then)."""
        self.settings, self.info = settings, info
        self.pipeline: Optional[Pipeline] = None  # the rank's stages, once built (train/loop.py)
        self.average: Optional[WeightAverage] = None  # --ema_decay's, evaluated too (train/loop.py)
        self.batch = settings.batch
        self.pipelined = settings.pipelined  # whose stages take batches of one shape
        self.eos = settings.packing.eos
        self.lines: dict[str, np.ndarray] = {}
        self.forwards: dict[str, int] = {}
        if settings.interval == 0:
            return
        path, layout = settings.data_path, settings.layout
        assert path is not None and layout is not None, "config.validate: --eval_interval needs --eval_data_path"
        sources = dataset_sources(path, settings.datasets, "eval_data_path", "eval_datasets")
        entries = on_rank0(
            lambda: scan(sources, layout, "eval_data_path", "eval_datasets"),
            DataError,
            lambda message: DataError(message, every_rank=True),
            timeout=timedelta(hours=1),
        )
        limit = settings.batches * self.batch if settings.batches else None
        for source in sources:
            name = source.name
            dataset = Dataset(name, location(source.root, "eval_data_path"), entries[name], layout)
            lines = eval_lines(dataset, settings.packing, limit)
            self.lines[name] = lines[info.dp_rank :: info.dp_size]
            self.forwards[name] = -(-len(lines) // (info.dp_size * self.batch))

    def due(self, step: int) -> bool:
        interval = self.settings.interval
        return interval > 0 and (step % interval == 0 or step == self.settings.num_steps)

    def run(self, step: int, model: torch.nn.Module) -> Report:
        """The evaluation at `step` as a record of its own, which --checkpoint_keep_best ranks by."""
        record = self.evaluate(model, step, self.pipeline)
        per_dataset = ", ".join(
            f"{k.split('/', 1)[1]} {v:.4f}" for k, v in record.items() if k.startswith("eval_loss/")
        )
        average = ""
        if self.average is not None:
            with self.average.swapped():
                averaged = self.evaluate(model, step, self.pipeline)
            record.update(averaged_metrics(averaged))
            record["eval_seconds"] += averaged["eval_seconds"]
            average = f" | ema loss {record['eval_loss_ema']:.4f}"
        line = (
            f"eval step {step} | loss {record['eval_loss']:.4f} | ppl {record['eval_ppl']:.2f} | "
            f"{per_dataset}{average} | tokens {record['eval_tokens']:,} | {record['eval_seconds']:.1f}s"
        )
        return Report(record["eval_seconds"], record, line, scores_checkpoint=True)

    def finish(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """Nothing held."""

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, step: int, pipeline: Optional[Pipeline] = None) -> dict[str, Any]:
        """The model's loss per dataset and over all of them (token-weighted). Every rank calls it; under
        pipeline parallelism through the rank's stages (`pipeline`), every batch padded with masked lines
        to --batch_size."""
        start = time.perf_counter()
        model.eval()
        sums = torch.zeros(len(self.lines), 2, dtype=torch.float64, device=self.info.device)
        for k, (name, lines) in enumerate(self.lines.items()):
            for b in range(self.forwards[name]):
                chunk = lines[b * self.batch : (b + 1) * self.batch]
                # a rank's share done, or a pipeline's fixed shape: masked lines keep the collectives paired
                pad = (self.batch if self.pipelined else 1) - len(chunk)
                if pad > 0:
                    chunk = np.concatenate(
                        [chunk, np.full((pad, self.settings.packing.seq_length + 1), _PAD, np.int64)]
                    )
                batch = torch.from_numpy(chunk).to(self.info.device)
                inputs = torch.where(batch[:, :-1] == _PAD, self.eos, batch[:, :-1])
                labels = torch.where(batch[:, 1:] == _PAD, IGNORE_INDEX, batch[:, 1:])
                count = (labels != IGNORE_INDEX).sum()
                if pipeline is None:
                    summed = model(inputs, labels=labels).double() * count
                else:
                    summed = pipeline.evaluate(inputs, labels)
                sums[k] += torch.stack([summed, count.double()])
        model.train()
        dist.all_reduce(sums)
        sums /= self.info.same_data  # every rank of a tensor-, context- and pipeline-parallel group has the same sums
        losses = {name: float(s / n) for name, (s, n) in zip(self.lines, sums.tolist())}
        total, tokens = sums.sum(0).tolist()
        record: dict[str, Any] = {"step": step, "eval_loss": total / tokens, "eval_ppl": math.exp(total / tokens)}
        record.update({f"eval_loss/{name}": loss for name, loss in losses.items()})
        record.update({f"eval_tokens/{name}": int(n) for name, (_, n) in zip(self.lines, sums.tolist())})
        record.update(eval_tokens=int(tokens), eval_seconds=time.perf_counter() - start)
        return record


def averaged_metrics(record: dict[str, Any]) -> dict[str, float]:
    """An evaluation of the weight average under its own names: eval_loss_ema, eval_ppl_ema,
    eval_loss_ema/<dataset>."""
    names = [k for k in record if k in ("eval_loss", "eval_ppl") or k.startswith("eval_loss/")]
    return {
        name.replace("eval_loss", "eval_loss_ema").replace("eval_ppl", "eval_ppl_ema"): record[name] for name in names
    }


def check_checkpoint_evaluation(settings: CheckpointEvalSettings) -> None:
    """`fms-evaluate`'s checks, before the run's facts: weights and data or tasks to evaluate them on, and
    a whole model (ConfigError naming the flag)."""
    if not settings.load_path or not (settings.data or settings.tasks):
        raise ConfigError(
            "--ckpt_load_path and --eval_data_path or --eval_harness_tasks are needed: the weights to evaluate "
            "and the data or tasks"
        )
    if settings.pipeline_parallel_size > 1:
        raise ConfigError(
            f"fms-evaluate runs the whole model on every rank: drop --pipeline_parallel_size="
            f"{settings.pipeline_parallel_size} (training evaluates through its stages with --eval_data_path)"
        )
    if settings.lora:
        raise ConfigError(
            "evaluation takes whole models: drop --lora_rank and give --ckpt_load_path a LoRA run's "
            "merged export (model_step_<N>.safetensors or exports/step_<N>)"
        )


def evaluate_once(model: torch.nn.Module, evaluator: Evaluator, harness: HarnessEvaluator) -> dict[str, Any]:
    """One evaluation of `model` (every rank calls it): the held-out data's losses, then the lm-eval tasks'
    scores, as one record (`fms-evaluate`: cli.py)."""
    record = evaluator.evaluate(model, 0) if evaluator.lines else {"step": 0}
    if harness.tasks is not None:
        record.update(harness.evaluate(model, 0))
    return record


def evaluation_lines(record: dict[str, Any]) -> list[str]:
    """What `fms-evaluate` prints of `record`: one `HARNESS <task>/<metric>=<value>` line per score, one
    `EVAL dataset=<name> loss=.. ppl=.. tokens=..` line per dataset and one for all."""
    lines = [f"HARNESS {k.split('/', 1)[1]}={v:.6f}" for k, v in record.items() if k.startswith("harness/")]
    if "eval_loss" not in record:
        return lines
    names = [k.split("/", 1)[1] for k in record if k.startswith("eval_loss/")]
    rows = [(name, record[f"eval_loss/{name}"], record[f"eval_tokens/{name}"]) for name in names]
    for name, loss, tokens in [*rows, ("all", record["eval_loss"], record["eval_tokens"])]:
        lines.append(f"EVAL dataset={name} loss={loss:.6f} ppl={math.exp(loss):.4f} tokens={tokens}")
    return lines
