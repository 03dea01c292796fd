"""Every line a process prints labelled with its replica group under --fault_tolerance, whose groups
share a console."""

from __future__ import annotations

import io
import sys
from typing import Any, TextIO, cast


class Labelled(io.TextIOBase):
    """A text stream whose every line begins with `label`: each replica group's output under
    --fault_tolerance, whose groups share a console."""

    def __init__(self, stream: Any, label: str):
        self.stream, self.label, self.fresh = stream, label, True

    def write(self, text: str) -> int:
        pieces = []
        for piece in text.splitlines(keepends=True):
            pieces.append(self.label + piece if self.fresh else piece)
            self.fresh = piece.endswith("\n")
        self.stream.write("".join(pieces))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

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
