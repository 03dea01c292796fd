"""The docs that are generated from code are up to date (the README's map of the package too), and CI runs the
README's test command."""

import importlib.util

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
