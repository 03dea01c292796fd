"""Test wrapper (started as a rank, in place of the script it runs): `io_counter.py <script> <args...>`
runs <script> as `python <script> <args...>` would (runpy, as __main__), counting the bytes this process
reads from and writes to checkpoint files, per file: reads of *.safetensors and DCP's *.distcp data files,
writes of *.safetensors (an export's files; the model file at the end is written under a temporary name,
.model_step_<N>.safetensors.tmp). Nothing is mocked: the real readers and writers run; only the openers
they use are wrapped, returning the real file behind a proxy that counts what read/readinto return and
what write takes:

- fms_fsdp.storage.open_random (hf_read.py's safetensors files: memory-mapped, read by read/readinto),
  replaced before any module imports it by name;
- io.open / builtins.open (Path.open and os.fdopen call io.open): items.py's DCP data files,
  hf_write.py's files (`open`, or os.fdopen for a file several ranks write).

At exit (normal or SystemExit) the counts go to $IO_COUNTS/rank<RANK>.json:
{path: {"read": bytes, "written": bytes}}."""

import builtins
import io
import json
import os
import runpy
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

counts: dict[str, dict[str, int]] = defaultdict(lambda: {"read": 0, "written": 0})
lock = threading.Lock()  # the export converts and writes in a thread of its own


def add(path: str, kind: str, n: Any) -> None:
    if n:
        with lock:
            counts[path][kind] += int(n)


class Counted:
    """A file (any: a builtin one, pyarrow's memory map) whose reads and writes are counted under `path`."""

    def __init__(self, f: Any, path: str):
        self._f, self._path = f, path

    def read(self, *args: Any) -> Any:
        data = self._f.read(*args)
        add(self._path, "read", len(data))
        return data

    def readinto(self, buffer: Any) -> Any:
        n = self._f.readinto(buffer)
        add(self._path, "read", n)
        return n

    def write(self, data: Any) -> Any:
        n = self._f.write(data)
        add(self._path, "written", n)
        return n

    def __enter__(self) -> "Counted":
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:  # seek, tell, close, fileno, ...: the file's own
        return getattr(self._f, name)


def counted_path(file: Any, mode: str) -> str:
    """The path whose reads or writes are counted for io.open(file, mode); "" for any other."""
    if "b" not in mode:
        return ""
    if isinstance(file, int):  # os.fdopen
        try:
            path = os.readlink(f"/proc/self/fd/{file}")
        except OSError:
            return ""
    elif isinstance(file, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(file))
    else:
        return ""
    name = os.path.basename(path)
    if "r" in mode and "+" not in mode:
        return path if name.endswith((".safetensors", ".distcp")) else ""
    return path if ".safetensors" in name else ""


real_open = io.open


def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    f = real_open(file, mode, *args, **kwargs)
    path = counted_path(file, mode)
    return Counted(f, path) if path else f


io.open = builtins.open = counting_open

import fms_fsdp.storage  # noqa: E402  (after the opener is wrapped; before any module takes open_random)

real_open_random = fms_fsdp.storage.open_random


def counting_open_random(path: Path) -> Any:
    f = real_open_random(path)
    return Counted(f, os.path.abspath(os.fspath(path))) if str(path).endswith(".safetensors") else f


fms_fsdp.storage.open_random = counting_open_random
# no module has taken the real one by name yet (`from fms_fsdp.storage import open_random`)
taken = [
    m
    for m, v in list(sys.modules.items())
    if m.startswith("fms_fsdp.") and m != "fms_fsdp.storage" and getattr(v, "open_random", None) is real_open_random
]
assert not taken, taken


def save() -> None:
    out = Path(os.environ["IO_COUNTS"])
    out.mkdir(parents=True, exist_ok=True)
    with lock:
        text = json.dumps(dict(counts), indent=1)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(text)


script = os.path.abspath(sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path[0] = os.path.dirname(script)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    save()
