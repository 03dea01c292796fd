"""docs/troubleshooting.md's messages, one registry (tests/error_cases.py): each case that gives fms-train
flags ends in its message at start-up, and every message the package raises has a row there (or in the
fault matrix, tests/test_faults.py)."""

from __future__ import annotations

import ast
import re
from typing import Iterator, Optional

import pytest
from error_cases import ERRORS, E
from test_faults import FAULTS

from fms_fsdp.cli import USER_ERRORS
from fms_fsdp.flags import parse_args
from fms_fsdp.startup import facts

from conftest import ROOT, TINY

KINDS = {kind.__name__ for kind in USER_ERRORS}


def pattern(says: str) -> re.Pattern:
    """A row's line as a regex: `<name>` stands for any text."""
    return re.compile("".join(".+?" if re.fullmatch(r"<\w+>", p) else re.escape(p) for p in re.split(r"(<\w+>)", says)))


@pytest.mark.parametrize("case", [e for e in ERRORS if e.flags is not None], ids=lambda e: e.says[:40])
def test_each_case_with_flags_ends_in_its_message_at_start_up(case: E, monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, str(case.world))
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    with pytest.raises(USER_ERRORS) as error:
        facts(parse_args([*TINY, *(case.flags or ())]))
    assert pattern(case.says).fullmatch(str(error.value)), str(error.value)


def _fragments(node: ast.expr) -> Optional[list[str]]:
    """The literal text of a message built from strings, f-strings and their sums (None: built otherwise)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _fragments(node.left), _fragments(node.right)
        return None if left is None or right is None else left + right
    return None


def raised_messages() -> Iterator[tuple[str, str]]:
    """(file:line, the longest literal piece of its message) of every user error the package raises with
    a message written there."""
    for path in sorted((ROOT / "fms_fsdp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in KINDS and node.args:
                pieces = _fragments(node.args[0])
                if pieces:
                    yield f"{path.relative_to(ROOT)}:{node.lineno}", max(pieces, key=len).strip()


def test_every_message_the_package_raises_has_a_row():
    rows = [e.says for e in ERRORS] + [f.says for f in FAULTS]
    found = list(raised_messages())
    missing = [f"{where}: {piece!r}" for where, piece in found if not any(piece in row for row in rows)]
    assert len(found) > 200 and not missing, (
        "messages without a row: add an E(...) row to tests/error_cases.py for each, then run "
        "python scripts/gen_docs.py\n" + "\n".join(missing)
    )


def test_the_registry_sections_and_rows_are_well_formed():
    from error_cases import SECTIONS

    assert all(e.section in SECTIONS for e in ERRORS)
    says = [e.says for e in ERRORS]
    assert len(says) == len(set(says)), [s for s in says if says.count(s) > 1]
