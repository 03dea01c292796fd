"""The package's structure: errors is a leaf, config imports nothing of the package but errors, no
import cycle anywhere, scripts are entry points, every console script resolves, only the command layer, run and settings see the
flat config, and modules, functions and the top folder stay small."""

import ast
import collections
import dataclasses
import importlib
import inspect
import os
import subprocess
import sys

import pytest
import tomllib

from conftest import ROOT

PACKAGE = ROOT / "fms_fsdp"


def module_name(path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_imports() -> dict[str, set[str]]:
    """Each fms_fsdp module -> the fms_fsdp modules it imports (at module level or inside functions)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def test_errors_is_a_leaf_and_config_imports_only_errors():
    graph = package_imports()
    assert graph["fms_fsdp.errors"] == set()
    assert graph["fms_fsdp.config"] == {"fms_fsdp.errors"}


def test_no_import_cycle_in_the_package():
    graph = package_imports()
    done, path = set(), []

    def visit(name: str) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name) :] + [name]))
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name]):
            # a package's __init__ runs before its submodules: importing `a.b` imports `a` first
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_only_the_command_layer_sets_warning_filters_and_logger_levels():
    """Library code leaves the process's warning filters and loggers as it found them (a filter inside
    `with warnings.catch_warnings()` is scoped; float8's import restores the levels it lowers)."""
    for path in PACKAGE.rglob("*.py"):
        if path.name in ("cli.py", "console.py"):  # the command layer
            continue
        tree = ast.parse(path.read_text())
        scoped = {
            id(n)
            for w in ast.walk(tree)
            if isinstance(w, ast.With) and any("catch_warnings" in ast.unparse(item.context_expr) for item in w.items)
            for n in ast.walk(w)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = ast.unparse(node.func)
                if name in ("warnings.filterwarnings", "warnings.simplefilter"):
                    assert id(node) in scoped, f"{path.name}:{node.lineno}: {name} outside catch_warnings"
                if node.func.attr == "setLevel":
                    assert path.name == "float8.py", f"{path.name}:{node.lineno}: a logger's level set"


def test_scripts_are_entry_points_of_a_few_lines():
    """Their logic lives in fms_fsdp/ (scripts/gen_docs.py, a docs tool, aside)."""
    scripts = [p for p in (ROOT / "scripts").glob("*.py") if p.name != "gen_docs.py"]
    for script in [*scripts, ROOT / "fms_to_hf.py", ROOT / "main_training.py"]:
        tree = ast.parse(script.read_text())
        assert not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body), script.name
        assert len(script.read_text().splitlines()) <= 15, script.name


def test_every_console_script_resolves_to_a_callable_of_the_command_layer():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"fms-train", "fms-prepare-data", "fms-inspect-data", "fms-export-model", "fms-to-hf"} <= set(scripts)
    assert {target.split(":")[0] for target in scripts.values()} == {"fms_fsdp.cli"}
    for name, target in scripts.items():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), name


# the modules that may see the flat config: where it is declared, read and turned into settings, and
# those not yet given settings of their own (the list may only shrink: a new component takes a
# settings object built in settings.py)
SEES_THE_CONFIG = {
    "fms_fsdp",  # __init__: the public names
    "fms_fsdp.config",
    "fms_fsdp.flags",
    "fms_fsdp.cli",
    "fms_fsdp.context",  # the run's context keeps the flags for start-up (its type only)
    "fms_fsdp.startup",
    "fms_fsdp.settings",
}


def test_only_start_up_and_the_listed_modules_name_the_flat_config():
    """A component receives its settings (run.settings), not train_config."""
    naming = {module_name(p) for p in PACKAGE.rglob("*.py") if "train_config" in p.read_text()}
    assert naming <= SEES_THE_CONFIG, f"build settings for these in fms_fsdp/settings.py: {naming - SEES_THE_CONFIG}"
    assert naming == SEES_THE_CONFIG, f"these no longer name it: take them off the list {SEES_THE_CONFIG - naming}"
    assert len(SEES_THE_CONFIG) == 7  # exactly: the list only shrinks, and this number with it


# the modules that read the flat config's fields (`cfg.<field>`, `run.cfg.<field>`): where it is declared
# and turned into settings, the command layer, and those not yet given settings of their own (the list
# may only shrink; the goal is at most 6 modules)
READS_THE_CONFIG = {
    "fms_fsdp.config",
    "fms_fsdp.cli",
    "fms_fsdp.context",  # the run's paths and variant, from --ckpt_save_path and --model_variant
    "fms_fsdp.startup",
    "fms_fsdp.settings",
}


def reads_a_field(node: ast.AST) -> bool:
    """`cfg.<field>` or `<something>.cfg.<field>`."""
    if not isinstance(node, ast.Attribute):
        return False
    owner = node.value
    return (isinstance(owner, ast.Name) and owner.id == "cfg") or (
        isinstance(owner, ast.Attribute) and owner.attr == "cfg"
    )


def test_only_start_up_and_the_listed_modules_read_the_flat_configs_fields():
    """A field of the flat config is read where the settings are built, not in the components."""
    reading = {
        module_name(p) for p in PACKAGE.rglob("*.py") if any(map(reads_a_field, ast.walk(ast.parse(p.read_text()))))
    }
    assert reading <= READS_THE_CONFIG, (
        f"build settings for these in fms_fsdp/settings.py: {reading - READS_THE_CONFIG}"
    )
    assert reading == READS_THE_CONFIG, f"these no longer read it: take them off the list {READS_THE_CONFIG - reading}"
    assert len(READS_THE_CONFIG) == 5  # exactly: the list only shrinks, and this number with it


# config.py is the field table: one entry per flag (help, choices, bounds, fault tolerance's `shared`),
# the single source of --help, the checks and docs/configuration.md; it grows by one entry per flag
LONG_BY_DESIGN = {"fms_fsdp.config"}


def test_modules_functions_and_folders_stay_small():
    """No module over 450 lines (but the field table), no function over 60, at most 22 modules at the top."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    long_modules = {
        name: n
        for name, path in modules.items()
        if (n := len(path.read_text().splitlines())) > 450 and name not in LONG_BY_DESIGN
    }
    assert not long_modules, f"split these modules by concern: {long_modules}"
    long_functions = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in modules.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long_functions, long_functions
    top = [p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 22, f"{len(top)} modules directly in fms_fsdp/: group them in folders by concern"


# the calls that must name their arguments: a settings class, the loop, a training step, a loader (two ints
# swapped in a positional call is a bug neither mypy nor a reader sees)
KEYWORD_CALLS = ("Loop", "train_step", "StatefulLoader", "DummyDataLoader", "DatasetReader")
VALUES = (
    "Packing",
    "Options",
    "Layout",
    "LoRASpec",
    "Recipe",
    "Engine",
    "Setting",
    "of",
)  # what the settings hold, the memory plan's setting, and FTSettings.of
# where they are defined: their parameters after the first are keyword-only
KEYWORD_ONLY = {
    "fms_fsdp.train.step": "train_step",
    "fms_fsdp.data.loader": "StatefulLoader",
    "fms_fsdp.data.dummy": "DummyDataLoader",
    "fms_fsdp.data.stream": "DatasetReader",
}


def called_name(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def test_settings_the_loop_its_step_and_the_loaders_are_called_by_keyword():
    """At most 3 positional arguments to any of them; settings classes take keywords only."""
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    positional = [
        f"{p.relative_to(ROOT)}:{node.lineno} {called_name(node)} ({len(node.args)} positional)"
        for p in files
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call)
        and (called_name(node).endswith("Settings") or called_name(node) in (*KEYWORD_CALLS, *VALUES))
        and len(node.args) > 3
    ]
    assert not positional, positional
    for module, name in KEYWORD_ONLY.items():
        parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters.values()
        by_place = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(by_place) <= 1, f"{module}.{name}: make the parameters after the first keyword-only: {by_place}"
    classes = [
        getattr(importlib.import_module(module_name(p)), node.name)
        for p in PACKAGE.rglob("*.py")
        for node in ast.parse(p.read_text()).body
        if isinstance(node, ast.ClassDef) and (node.name.endswith("Settings") or node.name == "Loop")
    ]
    assert len(classes) >= 25
    by_position = [c.__qualname__ for c in classes if not all(f.kw_only for f in dataclasses.fields(c) if f.init)]
    assert not by_position, f"make these @dataclass(kw_only=True): {by_position}"


# the flags read at start-up rather than turned into a component's settings (fms_fsdp/startup.py, cli.py)
READ_AT_START_UP = {
    "dry_run",
    "plan_world_size",
    "rope_scaling_factor",
    "rope_theta",
    "moe_experts",
    "moe_top_k",
    "moe_shared_experts",
    "norm_eps",
    "max_position_embeddings",
    "ramp_unit",  # the schedules turned into steps, for the run's data-parallel ranks
}


def filled_by_name(path) -> set[str]:
    """The flags that settings.py's `by_name(<class>, cfg, **given)` calls fill: each class's fields not given."""
    import fms_fsdp.settings as settings

    filled = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "by_name":
            cls = getattr(settings, node.args[0].id)
            filled |= {f.name for f in dataclasses.fields(cls)} - {k.arg for k in node.keywords}
    return filled


def test_every_flag_reaches_a_setting_or_is_read_at_start_up():
    """Each field of the flat config is read in settings.py (`cfg.<flag>`, or a field of the same name that
    `by_name` fills), or is one of READ_AT_START_UP: a flag that no component sees would be accepted and do
    nothing."""
    from fms_fsdp.config import train_config

    def read_in(path) -> set[str]:
        return {n.attr for n in ast.walk(ast.parse(path.read_text())) if reads_a_field(n)}

    flags = {f.name for f in dataclasses.fields(train_config)}
    by_name = filled_by_name(PACKAGE / "settings.py")
    settings = read_in(PACKAGE / "settings.py") | by_name
    start_up = set().union(*(read_in(PACKAGE / name) for name in ("startup.py", "cli.py")))
    assert flags - settings - start_up == set(), "flags that nothing reads"
    assert flags - settings == READ_AT_START_UP
    assert READ_AT_START_UP <= start_up
    assert len(by_name) >= 40  # most flags reach their settings by name


def test_every_settings_class_is_built_by_name():
    """settings.py builds each component's settings through `by_name` (its renamed fields given), so that a
    flag added under a field's name reaches any of them with no line there; only the whole `Settings` is
    called directly."""
    direct = [
        f"settings.py:{node.lineno} {called_name(node)}"
        for node in ast.walk(ast.parse((PACKAGE / "settings.py").read_text()))
        if isinstance(node, ast.Call) and called_name(node).endswith("Settings") and called_name(node) != "Settings"
    ]
    assert not direct, f"build these with by_name(<class>, cfg, ...): {direct}"
    built = {
        node.args[0].id
        for node in ast.walk(ast.parse((PACKAGE / "settings.py").read_text()))
        if isinstance(node, ast.Call) and called_name(node) == "by_name"
    }
    assert len(built) == 23, sorted(built)  # every one of them


# what a new flag takes: its entry in the field table and a field of the same name in a settings class (the
# component that uses it is the third file); the flag's help, checks and docs come from the entry
NEW_FLAG = """    probe_window: int = _f(3, "How many steps the probe looks back.", min=1, shared=False)
"""
NEW_SETTING = "    probe_window: int = 3\n"


# a settings class whose fields are all flags (the loop's), and one whose fields are named otherwise, given
@pytest.mark.parametrize(
    "where, anchor, part",
    [
        ("train/settings.py", "    ema_decay: float = 0.0", "loop"),
        ("checkpoint/settings.py", "    policy: KeepPolicy", "checkpoint"),
    ],
)
def test_a_new_flag_reaches_its_setting_through_two_files(tmp_path, where, anchor, part):
    """A copy of the package with a flag added to config.py and to a settings class, nothing else: the flag
    parses, is checked, shows in --help and reaches the component's settings."""
    copy = tmp_path / "fms_fsdp"
    subprocess.run(["cp", "-r", str(PACKAGE), str(copy)], check=True)
    config, settings = copy / "config.py", copy / where
    text = config.read_text()
    config.write_text(text.replace("    ema_decay: float = _f(", NEW_FLAG + "    ema_decay: float = _f(", 1))
    text = settings.read_text()
    assert text.count(anchor) == 1
    settings.write_text(text.replace(anchor, NEW_SETTING + anchor, 1))
    changed = subprocess.run(
        ["diff", "-rq", "-x", "__pycache__", str(PACKAGE), str(copy)], capture_output=True, text=True
    ).stdout.splitlines()
    assert len(changed) == 2, changed
    probe = """
import sys
from fms_fsdp.errors import ConfigError
from fms_fsdp.flags import format_help, parse_args
from fms_fsdp.settings import settings_of
flags = ["--use_dummy_dataset=True", "--device=cpu", f"--ckpt_save_path={sys.argv[1]}"]
print(getattr(settings_of(parse_args([*flags, "--probe_window=7"]), vocab_size=256), sys.argv[2]).probe_window)
print(getattr(settings_of(parse_args(flags), vocab_size=256), sys.argv[2]).probe_window)
try:
    parse_args([*flags, "--probe_window=0"])
except ConfigError as e:
    print(e)
print(format_help())
"""
    run = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "run"), part],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[:2] == ["7", "3"] and "--probe_window" in lines[2], lines
    assert "How many steps the probe looks back." in run.stdout  # --help


def test_no_module_shadows_the_standard_library_and_base_names_are_unique():
    """`inspect.py`, `io.py` beside the standard library's, or two `reader.py`s, make a reader (and a
    traceback) ask which one is meant; only `settings.py` is one per folder by design."""
    stems = [p.stem for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"]
    assert not [s for s in stems if s in sys.stdlib_module_names]
    shared = sorted(s for s, n in collections.Counter(stems).items() if n > 1)
    assert shared == ["settings"], shared


def room(module: str) -> str:
    """The folder (or top module) a module is in: fms_fsdp.checkpoint.save -> checkpoint."""
    return module.split(".")[1] if "." in module else ""


RUN = {"fms_fsdp.context", "fms_fsdp.startup"}


def test_the_runs_context_imports_no_component():
    """context.py holds the run's facts and imports only the flags' table and the storage paths it
    resolves (components' types under TYPE_CHECKING alone), so that anything may hold a `Run`."""
    code = "import sys, fms_fsdp.context; print(sorted(m for m in sys.modules if m.startswith('fms_fsdp.')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['fms_fsdp.config', 'fms_fsdp.context', 'fms_fsdp.errors', 'fms_fsdp.storage']", out


def test_components_do_not_import_the_run_and_every_arrow_points_down():
    """The components take their settings, paths and a log function, not the run (context.py, whose
    `cfg` is the flat config, and startup.py, which builds it); and no two folders or top modules import each other (what they share
    sits below both: periodic.py, resilience/, small protocols a caller passes in)."""
    graph = package_imports()
    components = ("checkpoint", "weights", "evaluation", "data", "model", "parallel", "memory")
    taking_the_run = sorted(m for m, deps in graph.items() if room(m) in components and deps & RUN)
    assert not taking_the_run, taking_the_run
    arrows = {(room(m), room(d)) for m, deps in graph.items() for d in deps if room(m) and room(d) != room(m)}
    both_ways = sorted({tuple(sorted(a)) for a in arrows if a[::-1] in arrows})
    assert not both_ways, both_ways


def test_the_training_folder_holds_the_loop_only():
    """train/: the loop and its step, guard and settings; the model's build is in parallel/, the rehearsal next to the
    memory plan, resilience/ the rest."""
    assert len([p for p in (PACKAGE / "train").glob("*.py") if p.name != "__init__.py"]) <= 7


def test_the_loader_imports_without_the_preparation_or_ray():
    """A run without --cache_dir loads neither fms-prepare-data's code (data/prepare/) nor Ray."""
    code = (
        "import sys, fms_fsdp.data.make_loader; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('fms_fsdp.data.prepare.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['fms_fsdp.data.prepare.settings']", out


def test_the_settings_import_without_the_model_or_the_memory_plan():
    """A process that builds settings from the flags (a loader, a tool) loads neither fms's models and
    modules nor the memory plan, the model's assembly or the parallel wrappers: each folder keeps its
    settings in a light settings.py."""
    code = (
        "import sys, fms_fsdp.settings; "
        "print(sorted(m for m in sys.modules if m == 'fms' or m.startswith(('fms.', 'fms_fsdp.memory.plan', "
        "'fms_fsdp.model.variants', 'fms_fsdp.parallel.mesh', 'fms_fsdp.parallel.parallelize', "
        "'fms_fsdp.parallel.pipeline', 'fms_fsdp.train.step'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
