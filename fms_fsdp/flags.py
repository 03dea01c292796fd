"""Reading flags: `--name=value` command lines, `--config` files (YAML with `!include` and sections, or
JSON), coercion of each value to its field's type, typo suggestions, and the help and reference text.

`parse_args` builds the training `train_config` (config.py holds its fields and their checks);
`parse_call` reads a tool's flags into the keyword arguments of its function (cli.py), with the same
rules, so every command of the package reads its command line alike.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import math
import os
import sys
import types
import typing
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import yaml

from fms_fsdp.config import FIELDS, HINTS, IGNORED_FMS_FSDP_FLAGS, train_config, validate
from fms_fsdp.errors import ConfigError, first_line

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", ""}


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"comma list of {_type_name(args[0])}"
    return "none" if tp is type(None) else tp.__name__


def _scalar(value: Any, tp: type) -> Any:
    """Coerce one scalar (a string from the command line, or a YAML/JSON value) to tp."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, str)) and str(value).strip().lower() in _TRUE | _FALSE:
            return str(value).strip().lower() in _TRUE
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = Fraction(value) if isinstance(value, float) else Fraction(str(value).strip().replace("_", ""))
        if number.denominator == 1:
            return int(number)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        if isinstance(value, str):
            return float(Fraction(value.strip().replace("_", "")))  # Fraction refuses nan and inf
    elif typing.get_origin(tp) in (Union, types.UnionType):  # the first member that takes it
        for member in typing.get_args(tp):
            try:
                return _scalar(value, member)
            except (ValueError, ZeroDivisionError):
                continue
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    raise ValueError


def coerce_to(flag: str, tp: Any, value: Any) -> Any:
    """Coerce a raw value (a command-line string, or a YAML/JSON value) to type `tp`; ConfigError naming
    --flag if it can't."""
    args = typing.get_args(tp)
    optional = type(None) in args
    inner = next((a for a in args if a is not type(None)), tp) if optional else tp
    try:
        if optional and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE)):
            return None
        if typing.get_origin(inner) is list:
            item = typing.get_args(inner)[0]
            if isinstance(value, str):
                value = [v for v in value.split(",") if v.strip()]
            elif not isinstance(value, (list, tuple)):
                value = [value]
            return [_scalar(v.strip() if isinstance(v, str) else v, item) for v in value]
        return _scalar(value, inner)
    except (ValueError, ZeroDivisionError, OverflowError):
        raise ConfigError(f"--{flag}: expected {_type_name(tp)}, got {value!r}") from None


def coerce(name: str, value: Any) -> Any:
    """Coerce a raw value to the type of train_config's field `name`."""
    return coerce_to(name, HINTS[name], value)


def _unknown(
    name: str, source: str, known: Sequence[str] = tuple(FIELDS), where: str = "docs/configuration.md"
) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else f"; see {where} for the flags"
    return ConfigError(f"unknown flag --{name}{source}{hint}")


def _note_ignored(name: str, source: str = "") -> None:
    """An fms-fsdp flag accepted and dropped: a note from rank 0."""
    if os.environ.get("RANK", "0") == "0":
        print(
            f"note: --{name}{source} is accepted for fms-fsdp scripts and ignored: {IGNORED_FMS_FSDP_FLAGS[name]}",
            file=sys.stderr,
        )


def _read_yaml(path: Path, includers: tuple[Path, ...]) -> Any:
    """A YAML file whose `!include other.yaml` values are the other files' contents (paths relative to
    the including file, nested, cycles refused)."""
    where = f" (included from {includers[-1]})" if includers else ""
    if path in includers:
        raise ConfigError(f"--config: {path} includes itself: {' -> '.join(map(str, (*includers, path)))}")
    _check_file(path, where)

    class Loader(yaml.SafeLoader):
        pass

    def include(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        return _read_yaml((path.parent / str(loader.construct_scalar(node))).resolve(), (*includers, path))

    Loader.add_constructor("!include", include)
    try:
        return yaml.load(path.read_text(), Loader=Loader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config: cannot parse {path}{where}: {first_line(e)}") from None


def _check_file(path: Path, where: str) -> None:
    if path.is_dir():
        raise ConfigError(f"--config: {path}{where} is a folder, not a config file")
    if not path.is_file():
        raise ConfigError(f"--config: file not found: {path}{where}")


def _flatten(data: dict[str, Any]) -> dict[str, Any]:
    """The fields of a config mapping whose sections (mappings) hold fields or further sections."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat.update(_flatten(value) if isinstance(value, dict) else {key: value})
    return flat


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict of raw values. A YAML file may include others
    (`data: !include data.yaml`) and group its fields in sections (a mapping under any name, nested
    or not, as Levanter's files do): sections are flattened in the order they appear, later values
    winning. fms-fsdp's ignored flags are dropped with a note, as on the command line."""
    p = Path(path).resolve()
    if p.suffix == ".json":
        _check_file(p, "")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config: cannot parse {path}: {first_line(e)}") from None
    else:
        data = _read_yaml(p, ())
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of field: value")
    flat = {}
    for key, value in _flatten(data).items():
        if key in IGNORED_FMS_FSDP_FLAGS:
            _note_ignored(str(key), f" (in {path})")
        elif key not in FIELDS:
            raise _unknown(str(key), f" in {path}")
        else:
            flat[key] = value
    return flat


def _short(arg: str) -> bool:
    """A one-letter flag: -o, -o=value."""
    return len(arg) >= 2 and arg[0] == "-" and arg[1].isalpha() and (len(arg) == 2 or arg[2] == "=")


def _written(name: str) -> str:
    """A flag as the command line writes it: -o, --name."""
    return f"-{name}" if len(name) == 1 else f"--{name}"


def _split_argv(
    argv: Sequence[str], hints: Mapping[str, Any], positional: bool = False
) -> tuple[list[str], list[tuple[str, Optional[str]]]]:
    """Turn ['--a=1', '--b', '2', '--flag', '--noflag', '-o', 'x'] into positional arguments (when
    `positional`) and (name, raw value or None) pairs; `hints` gives the types (a bare boolean flag is
    true, --noflag false; a one-letter flag may be written -o value)."""
    args: list[str] = []
    pairs: list[tuple[str, Optional[str]]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not (arg.startswith("--") and len(arg) > 2) and not _short(arg):
            if not positional:
                raise ConfigError(f"unexpected argument {arg!r}: flags are written --name=value")
            args.append(arg)
            i += 1
            continue
        name, eq, value = arg.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("--") and not _short(nxt):  # --seed -1 takes -1
                value, i = nxt, i + 1
            elif name.startswith("no") and hints.get(name[2:]) is bool:
                name, value = name[2:], "false"
            elif hints.get(name) is bool:
                value = "true"
            else:
                pairs.append((name, None))
                i += 1
                continue
        pairs.append((name, value))
        i += 1
    return args, pairs


def parse_args(argv: Sequence[str]) -> train_config:
    """Build a validated train_config from command-line flags (and an optional --config file)."""
    _, pairs = _split_argv(argv, HINTS)
    raw: dict[str, Any] = {}
    config_files = [v for n, v in pairs if n == "config"]
    if len(config_files) > 1:
        raise ConfigError("--config given more than once")
    if config_files:
        if config_files[0] is None:
            raise ConfigError("--config needs a value: --config=run.yaml")
        raw.update(load_config_file(config_files[0]))
    for name, value in pairs:  # a flag given twice: the later one wins, as in scripts that append "$@"
        if name == "config":
            continue
        if name in IGNORED_FMS_FSDP_FLAGS:
            _note_ignored(name)
            continue
        if name not in FIELDS:
            raise _unknown(name, "")
        if value is None:
            raise ConfigError(f"--{name} needs a value: --{name}=...")
        raw[name] = value
    return make_config(**raw)


def recorded_config(recorded: dict[str, Any]) -> train_config:
    """The train_config a checkpoint recorded (its metadata.pth), for tools that read it back: flags this
    release no longer has are left out, and nothing is validated (the run's trackers or tokenizer need not
    be here)."""
    return train_config(**{name: coerce(name, value) for name, value in recorded.items() if name in FIELDS})


def make_config(**raw: Any) -> train_config:
    """Coerce raw values onto a train_config and validate it."""
    for name in raw:
        if name not in FIELDS:
            raise _unknown(name, "")
    cfg = train_config(**{name: coerce(name, value) for name, value in raw.items()})
    validate(cfg)
    return cfg


def parse_call(func: Callable[..., Any], argv: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    """A tool's command line as (positional, keyword) arguments of `func`: its keyword parameters are
    the flags, coerced to their annotated types; a *args parameter takes the positional arguments."""
    params = inspect.signature(func).parameters
    hints = typing.get_type_hints(func)
    flags = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    star = next((n for n, p in params.items() if p.kind == p.VAR_POSITIONAL), None)
    args, pairs = _split_argv(argv, hints, positional=star is not None)
    kwargs: dict[str, Any] = {}
    for name, value in pairs:
        if name not in flags:
            raise _unknown(name, "", flags, where="--help")
        if value is None:
            raise ConfigError(f"{_written(name)} needs a value: {_written(name)}=...")
        kwargs[name] = coerce_to(name, hints.get(name, str), value)
    return [coerce_to(star, hints.get(star, str), a) for a in args] if star else [], kwargs


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


TRAINING_USAGE = "usage: torchrun [...] main_training.py [--config=run.yaml] [--field=value ...]"


def flag_sections() -> dict[str, str]:
    """Each flag -> its section of train_config (the `# model`, `# data`, ... comments above its fields)."""
    sections, section = {}, ""
    try:
        source = inspect.getsource(train_config)
    except OSError:  # installed without its sources: one section
        return {name: "" for name in FIELDS}
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("# ") and line.startswith("    #"):
            section = stripped[2:]
        elif (name := stripped.split(":", 1)[0]) in FIELDS and line.startswith(f"    {name}:"):
            sections[name] = section
    return sections


def format_help(
    usage: str = TRAINING_USAGE, sections: Optional[Sequence[str]] = None, names: Sequence[str] = ()
) -> str:
    """`usage`, then one line per flag (when `sections` are given, theirs and `names` only): name, type,
    default and help."""
    lines = [usage, ""]
    of = flag_sections()
    for name, f in FIELDS.items():
        if sections is None or of[name] in sections or name in names or not of[name]:
            lines.append(f"  --{name} ({_type_name(HINTS[name])}, default {_default(f)!r}): {f.metadata['help']}")
    return "\n".join(lines)


def markdown_reference() -> str:
    """Every flag as a Markdown table (docs/configuration.md is generated from it)."""
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for name, f in FIELDS.items():
        extra = []
        if f.metadata["choices"]:
            extra.append("one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"]))
        if f.metadata["min"] is not None:
            extra.append(f">= {f.metadata['min']}")
        if f.metadata["shared"]:
            extra.append("shared by every --fault_tolerance replica group")
        meaning = f.metadata["help"] + (f" ({'; '.join(extra)})" if extra else "")
        rows.append(f"| `--{name}` | {_type_name(HINTS[name])} | `{_default(f)!r}` | {meaning} |")
    return "\n".join(rows)
