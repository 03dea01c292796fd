"""Downstream evaluation through lm-eval-harness (--eval_harness_tasks; the `harness` extra, `lm-eval`):
every --eval_harness_interval steps and at the end of a training run, or of any model (`fms-evaluate`).

Every rank runs lm-eval on the same tasks and so builds the same requests. `HarnessModel` sorts each
list of requests by length, deals them out over the data-parallel ranks and scores them with the model
as it trains (sharded, compiled, no export): every rank runs as many forward passes as the busiest (an
idle rank's are padding, keeping FSDP's collectives paired), of [batch, 2^k tokens] (a few shapes: few
recompiles), then the scores are all-reduced, so every rank's lm-eval computes the same metrics and
rank 0 reports them. Tokenisation, context handling and rolling windows are lm-eval's own (TemplateLM,
as its Hugging Face model does), so a task scores as lm-eval scores the exported model. Only scored
tasks run (multiple_choice, loglikelihood, loglikelihood_rolling): generation would decode token by
token in lockstep on every rank, and such tasks are refused at start-up. The harness draws random
numbers of its own (few-shot sampling): the run's random state is restored after it.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from fms_fsdp.data.text import load_tokenizer
from fms_fsdp.errors import ConfigError, first_line
from fms_fsdp.parallel.process_group import DistInfo
from fms_fsdp.periodic import Report

SCORED = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")
MIN_TOKENS = 64  # the shortest forward pass: lengths are 2^k from here to seq_length

try:  # an optional extra: its absence is a start-up error only when --eval_harness_tasks asks for it
    from lm_eval.api.model import TemplateLM
except ImportError:  # pragma: no cover - the class below is then never instantiated
    TemplateLM = object


@dataclass(frozen=True, kw_only=True)
class HarnessSettings:
    """--eval_harness_tasks and what scoring them needs (built once: settings.py)."""

    tasks: tuple[str, ...]  # the names --eval_harness_tasks gives, empty without it
    include_path: Optional[str]  # --eval_harness_include_path
    tokenizer_path: Optional[str]
    interval: int  # --eval_harness_interval (0: at the last step only)
    limit: Optional[int]  # --eval_harness_limit, None for every document
    num_steps: int
    seq_length: int
    batch: int  # --eval_batch_size, else --batch_size
    eos: int
    prefix: int  # --bos_token, else --eos_token: what a context begins with, as lm-eval's HFLM
    cp: int  # --context_parallel_size
    tp: int  # --tensor_parallel_size


def task_names(spec: Optional[str]) -> tuple[str, ...]:
    """The names --eval_harness_tasks gives."""
    return tuple(t.strip() for t in (spec or "").split(",") if t.strip())


@functools.lru_cache(maxsize=4)
def task_manager(include_path: Optional[str]) -> Any:
    """lm-eval's index of its tasks and those under `include_path` (a few seconds: built once)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def check_harness(settings: HarnessSettings) -> None:
    """Start-up checks of --eval_harness_tasks: lm-eval installed, a tokenizer, every task known."""
    names = settings.tasks
    if not names:
        return
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(
            "--eval_harness_tasks needs lm-eval: pip install lm-eval (this package's [harness] extra)"
        ) from None
    if settings.tokenizer_path is None:
        raise ConfigError("--eval_harness_tasks needs --tokenizer_path: the tasks are text, tokenized for the model")
    known = task_manager(settings.include_path).all_tasks
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            where = f" or under --eval_harness_include_path={settings.include_path}" * bool(settings.include_path)
            raise ConfigError(
                f"--eval_harness_tasks: unknown task {name!r} (not among lm-eval's tasks{where})"
                + (f"; did you mean {', '.join(near)}?" if near else "")
            )


def load_tasks(settings: HarnessSettings) -> dict[str, Any]:
    """lm-eval's tasks of --eval_harness_tasks (their documents loaded); ConfigError for a task that
    generates text."""
    try:
        task_dict = task_manager(settings.include_path).load(list(settings.tasks))
    except Exception as e:  # a task's dataset that cannot be read: name it, in one line
        raise ConfigError(
            f"--eval_harness_tasks: cannot load {','.join(settings.tasks)} ({type(e).__name__}: {first_line(e)})"
        ) from None
    for name, task in task_dict["tasks"].items():
        kind = task.get_config("output_type")
        if kind not in SCORED:
            raise ConfigError(
                f"--eval_harness_tasks: {name} is a {kind} task; only scored tasks ({', '.join(SCORED)}) run in the loop"
            )
    return task_dict


class HarnessModel(TemplateLM):  # type: ignore[misc,valid-type]
    """The model as lm-eval's LM: loglikelihoods scored across the data-parallel ranks (see the module)."""

    def __init__(self, model: torch.nn.Module, settings: HarnessSettings, info: DistInfo, tokenizer: Any):
        super().__init__()
        self.model, self.info, self.tokenizer = model, info, tokenizer
        self.max_length, self.batch = settings.seq_length, settings.batch
        self.eos = settings.eos
        # lengths a forward pass can take: a context-parallel group cuts them in 2C chunks, tensor parallel
        # each rank's part in T (seq_length itself is checked to fit at start-up)
        cp, tp = settings.cp, settings.tp
        self.unit = math.lcm(2 * cp, cp * tp) if cp > 1 else tp
        self.prefix = settings.prefix

    @property
    def eot_token_id(self) -> int:
        return self.eos

    @property
    def prefix_token_id(self) -> int:
        return self.prefix

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=False).ids

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation) of
        each (_, context tokens, continuation tokens), context truncated on the left to seq_length."""
        rows = []
        for _, ctx, cont in requests:  # as lm-eval's HFLM: the context cut on the left to seq_length
            tokens = (ctx + cont)[-(self.max_length + 1) :][:-1]
            count = min(len(cont), len(tokens))
            rows.append((tokens, count, cont[-count:]))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        mine = order[self.info.dp_rank :: self.info.dp_size]
        forwards = -(-math.ceil(len(rows) / self.info.dp_size) // self.batch)
        scores = torch.zeros(len(rows), 2, dtype=torch.float64, device=self.info.device)
        for b in range(forwards):
            part = mine[b * self.batch : (b + 1) * self.batch]
            longest = max((len(rows[i][0]) for i in part), default=1)
            length = min(self.max_length, _round_up(max(MIN_TOKENS, 1 << (longest - 1).bit_length()), self.unit))
            tokens = torch.full((self.batch, length), self.eos, dtype=torch.long)
            for r, i in enumerate(part):
                tokens[r, : len(rows[i][0])] = torch.tensor(rows[i][0])
            logits = self.model(tokens.to(self.info.device))  # the same shape on every rank of a TP group
            for r, i in enumerate(part):
                n, count, cont = len(rows[i][0]), rows[i][1], rows[i][2]
                logprobs = logits[r, n - count : n].float().log_softmax(-1)
                target = torch.tensor(cont, device=logprobs.device)[:, None]
                greedy = (logprobs.argmax(-1) == target[:, 0]).all()
                scores[i] = torch.stack([logprobs.gather(-1, target).sum().double(), greedy.double()])
        dist.all_reduce(scores)
        scores /= self.info.same_data  # every rank of a tensor- (context-) parallel group scored the same requests
        return [(float(s), bool(g > 0.5)) for s, g in scores.tolist()]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's, its progress bar drawn by rank 0 alone."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.info.is_main)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in lm-eval's disjoint windows of seq_length."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix, max_seq_len=self.max_length, context_len=1
            ):
                windows.append((None, *make_disjoint_window(window)))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (score, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[k] += score
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        raise ConfigError("--eval_harness_tasks: generation tasks do not run in the loop (load_tasks refuses them)")


class HarnessEvaluator:
    """--eval_harness_tasks, loaded at start-up; `evaluate` scores the model on them (every rank). Periodic
    work of the loop (periodic.Periodic) every --eval_harness_interval steps and at the last."""

    reads_model = True

    def __init__(self, settings: HarnessSettings, info: DistInfo):
        self.settings, self.info = settings, info
        self.tasks: Optional[dict[str, Any]] = None
        if settings.tasks:
            self.tasks = load_tasks(settings)
            self.tokenizer = load_tokenizer(settings.tokenizer_path or "")

    def due(self, step: int) -> bool:
        interval = self.settings.interval
        return self.tasks is not None and ((interval > 0 and step % interval == 0) or step == self.settings.num_steps)

    def run(self, step: int, model: torch.nn.Module) -> Report:
        """The scores at `step` as a record of their own."""
        record = self.evaluate(model, step)
        scores = ", ".join(
            f"{k.split('/', 1)[1]} {v:.4f}"
            for k, v in record.items()
            if k.startswith("harness/") and not k.endswith("/sample_len")
        )
        line = f"harness step {step} | {scores} | {record['harness_seconds']:.1f}s"
        return Report(record["harness_seconds"], record, line, scores_checkpoint=True)

    def finish(self) -> None:
        """Nothing in flight."""

    def close(self) -> None:
        """Nothing held."""

    def evaluate(self, model: torch.nn.Module, step: int) -> dict[str, Any]:
        """{"step", "harness/<task>/<metric>": value, ..., "harness_seconds"}. Every rank calls it."""
        from lm_eval.evaluator import evaluate

        assert self.tasks is not None
        start = time.perf_counter()
        model.eval()
        with _own_random_state():
            results = evaluate(
                HarnessModel(model, self.settings, self.info, self.tokenizer),
                self.tasks,
                limit=self.settings.limit,
                bootstrap_iters=0,
                log_samples=False,
                verbosity="WARNING",
            )
        model.train()
        record: dict[str, Any] = {"step": step}
        for task, metrics in (results or {}).get("results", {}).items():
            for key, value in metrics.items():
                metric, _, kind = key.partition(",")
                if isinstance(value, (int, float)) and not metric.endswith("_stderr"):
                    record[f"harness/{task}/{metric}" + (f"/{kind}" if kind not in ("", "none") else "")] = value
        record["harness_seconds"] = time.perf_counter() - start
        return record


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@contextlib.contextmanager
def _own_random_state() -> Iterator[None]:
    """The harness's random draws leave the run's random state as it was."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)
