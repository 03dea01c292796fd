"""The docs that are generated from code are up to date, and CI runs the README's test command."""

import importlib.util

from conftest import ROOT


def test_configuration_doc_is_in_sync_with_the_dataclass():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert gen.render(text) == text, "run: python scripts/gen_config_docs.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/quickstart.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
