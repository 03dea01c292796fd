"""The benchmarks' own options (--name=value), read over their defaults."""

from __future__ import annotations

import sys


def parse_options(argv: list[str], defaults: dict[str, str], script: str) -> dict[str, str]:
    """`defaults` with argv's --name=value options over them; anything else: one line naming `script`
    and its options, and exit status 2."""
    options = dict(defaults)
    for arg in argv:
        name, sep, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not sep or name not in defaults:
            known = " ".join(f"--{n}=" for n in defaults)
            print(f"error: {script}: unknown option {arg!r}; options: {known}", file=sys.stderr)
            raise SystemExit(2)
        options[name] = value
    return options
