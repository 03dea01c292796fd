"""The docs that are generated from code are up to date (the README's map of the package too), and CI runs the
README's test command."""

import importlib.util
import json
import re
import subprocess
import sys

from conftest import ROOT


def test_generated_docs_are_in_sync_with_the_code_and_the_fault_matrix():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name in gen.DOCS:
        text = (ROOT / name).read_text()
        assert gen.render(name, text) == text, f"{name} is out of date: run python scripts/gen_docs.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/quickstart.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_test_extra_is_requirements_test_txt():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    lines = (ROOT / "requirements-test.txt").read_text().splitlines()
    listed = [line for line in lines if line.strip() and not line.startswith(("#", "-r"))]
    assert sorted(extra) == sorted(listed)


def test_every_module_opens_with_a_sentence_of_what_it_does():
    """The README's map is made of these (scripts/gen_docs.py's headline): none missing, none a paragraph."""
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    lengths = {p.relative_to(ROOT).as_posix(): len(gen.headline(p)) for p in (ROOT / "fms_fsdp").rglob("*.py")}
    assert {m: n for m, n in lengths.items() if not 8 <= n <= 200} == {}


# what the docs of a product do not say: this project's own history and machines, paths outside the
# repository other than a user's (the examples' /data, /tmp, /fsx, s3:// ...)
NOT_FOR_USERS = re.compile(
    r"/work/|\.\./shared|\.library|development machine|assigned per session|\bissue #?\d+|"
    r"\bthis (?:PR|commit|session)\b|\bwe (?:added|fixed|changed|renamed)\b|\bpreviously\b|\bno longer\b|"
    r"\bused to (?:be|say)\b",
    re.IGNORECASE,
)


def test_the_docs_speak_of_the_product_to_its_users():
    """README.md and docs/ say what the package does and how to run it: no line of its development's
    history, no path of the machines it was made on."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if (m := NOT_FOR_USERS.search(line))
    ]
    assert not found, found


def test_the_offline_tokenizer_of_the_data_guide_is_made_and_loads(tmp_path):
    """docs/data.md's tokenizer made from local text runs as written and gives a tokenizer.json that
    --tokenizer_path loads, its end-of-text token id 0 (the default --eos_token)."""
    from fms_fsdp.data.text import load_tokenizer

    text = (ROOT / "docs" / "data.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "made offline" in block)
    (tmp_path / "raw").mkdir()
    lines = [
        json.dumps({"text": f"document {i}: the quick brown fox jumps over {i % 7} lazy dogs"}) for i in range(300)
    ]
    (tmp_path / "raw" / "a.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer"))
    assert tokenizer.token_to_id("<|endoftext|>") == 0 and 256 < tokenizer.get_vocab_size() <= 32000
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False).ids
    assert tokenizer.decode(ids) == "the quick brown fox" and 0 not in ids


def test_a_package_docstring_that_lists_its_modules_lists_every_one():
    """A package's opening docstring that names its modules (`loop.py`, ...) names each module of the package,
    so the list cannot drift from the folder as modules are added."""
    import ast

    missing = {}
    for init in (ROOT / "fms_fsdp").rglob("__init__.py"):
        named = set(re.findall(r"\b(\w+)\.py\b", ast.get_docstring(ast.parse(init.read_text())) or ""))
        modules = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
        if named - {"gen_docs"} and modules - named:
            missing[init.parent.relative_to(ROOT).as_posix()] = sorted(modules - named)
    assert missing == {}
