"""What a command's processes print, set up by the command layer: the libraries' warnings and loggers
quieted (other ranks' warnings and progress bars off), every line labelled with its replica group under
--fault_tolerance, whose groups share a console, and torchft's own log kept in a file."""

from __future__ import annotations

import importlib
import io
import logging
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, TextIO, cast


class Labelled(io.TextIOBase):
    """A text stream whose every line begins with `label`: each replica group's output under
    --fault_tolerance, whose groups share a console. A line goes to `stream` in one write once it ends
    (an unfinished one at a flush), so that the groups' lines never interleave inside a line (a pipe keeps
    a write whole up to 4 KiB). Threads of the process (the background checkpoint writer, the watchdog)
    may print at once: one lock orders them."""

    def __init__(self, stream: Any, label: str):
        self.stream, self.label = stream, label
        self.pending, self.fresh = "", True  # the unfinished line; whether it begins a line
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            lines, ended, self.pending = (self.pending + text).rpartition("\n")
            if ended:  # whole lines, flushed at once: one write to the console
                self._send(lines + ended)
                self.stream.flush()
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                self._send(self.pending)
                self.pending = ""
            self.stream.flush()

    def _send(self, text: str) -> None:
        pieces = []
        for piece in text.splitlines(keepends=True):
            pieces.append(self.label + piece if self.fresh else piece)
            self.fresh = piece.endswith("\n")
        self.stream.write("".join(pieces))

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def label_groups(ft: Any) -> None:
    """Under --fault_tolerance (`ft`: its settings, None without it), every line this process prints
    begins with its replica group."""
    if ft is not None:
        sys.stdout = cast(TextIO, Labelled(sys.stdout, f"[group {ft.index}] "))
        sys.stderr = cast(TextIO, Labelled(sys.stderr, f"[group {ft.index}] "))


def quiet_library_noise() -> None:
    """What torch says at every step of a run that is not the user's business (the commands that train
    or evaluate call this, before they import the libraries; library code leaves warnings and loggers
    alone). Only rank 0 prints: the other ranks' warnings and progress bars, the same as rank 0's, are off."""
    if os.environ.get("RANK", "0") != "0":
        warnings.simplefilter("ignore")
        for bars in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
            os.environ[bars] = "1"  # tqdm's own (lm-eval's), Hugging Face datasets' and hub's
    # DCP's own handling of ShardedTensor, which holds fms's fused keys under tensor parallelism
    warnings.filterwarnings(
        "ignore", message="Please use DTensor instead and we are deprecating ShardedTensor", category=FutureWarning
    )
    # under tensor parallelism the embedding's output (this rank's part of the sequence) is a view; FSDP2
    # warns in case it is changed in place, which fms never does
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
    # every rank would log that gathering a whole (FSDP x TP)-sharded weight takes two all-gathers (exports)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    # lm-eval-harness (--eval_harness_tasks) logs each task's set-up: its warnings stay, on rank 0
    logging.getLogger("lm_eval").setLevel(logging.WARNING if os.environ.get("RANK", "0") == "0" else logging.ERROR)
    # torchft (--fault_tolerance) logs each quorum (its Rust side, at info) and a handled failure with its
    # traceback; resilience/ft.py says what happened in one line, and the group's torchft.log keeps torchft's lines
    # (file_torchft_log). A live transfer's tensors come from a read-only buffer
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    # torch.compile of torchao's 8-bit AdamW update (--optimizer_state_dtype=int8) asks its tensor type for
    # a hash to cache the compiled graph across processes; it recompiles instead
    warnings.filterwarnings("ignore", message="OptimState8bit does not implement _stable_hash_for_caching")


def import_quietly(name: str) -> ModuleType:
    """`import name` for torchao's modules, whose import says at warning level that its optional CUDA
    kernels cannot load (on a CPU, or another CUDA) and registers an enum torch no longer needs registered;
    errors still show. ImportError when it is not installed."""
    loggers = [logging.getLogger(logger) for logger in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def file_torchft_log(path: Optional[Path]) -> None:
    """torchft's own log (its quorums, live transfers, handled failures with their tracebacks) appended to
    `path` by every rank of the replica group, each line with its rank, never on the console (resilience/ft.py
    says what happened in one line); dropped where `path` is None (object storage)."""
    if path is None:
        return
    rank = os.environ.get("RANK", "0")
    handler = logging.FileHandler(path, mode="a", delay=True)  # opened at its first line, in the run's folder
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"))
    torchft = logging.getLogger("torchft")
    torchft.propagate = False
    torchft.addHandler(handler)
    torchft.setLevel(logging.INFO)
