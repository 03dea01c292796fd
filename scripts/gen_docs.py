"""Regenerate the docs' tables from the code: in README.md the map of the package (its module docstrings);
in docs/configuration.md the flags (the train_config dataclass), the model variants and which features
compose (tests/composition.py); in docs/troubleshooting.md the fault matrix (tests/test_faults.py:
what each fault looks like and its exit status, as the suite drives it) and every message
(tests/error_cases.py); with matplotlib installed, docs/lr_schedules.png from fms_fsdp/schedule.py.

    python scripts/gen_docs.py      (tests/test_docs.py fails when a table is out of date)
"""

import ast
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fms_fsdp.flags import markdown_reference, parse_args  # noqa: E402
from fms_fsdp.model.moe import MoEConfig, expert_width  # noqa: E402
from fms_fsdp.model.shapes import hidden_dim  # noqa: E402
from fms_fsdp.model.variants import ALIASES, VARIANTS, context_length, count_params, get_model_config  # noqa: E402
from fms_fsdp.schedule import lr_multiplier  # noqa: E402
from fms_fsdp.settings import schedule_of  # noqa: E402


def _experts(c) -> str:
    """A variant's experts: '8, top-2' (+ shared), or '-' for a dense one."""
    if not isinstance(c, MoEConfig):
        return "-"
    return f"{c.moe_experts}, top-{c.moe_top_k}" + (f" + {c.moe_shared_experts} shared" if c.moe_shared_experts else "")


def _width(c) -> int:
    return expert_width(c) if isinstance(c, MoEConfig) else hidden_dim(c)


def variants_table() -> str:
    """Every model variant with its dimensions (the FFN width is Hugging Face's intermediate_size),
    parameter count, and the config.json fields a Hugging Face --ckpt_load_path is checked against."""
    rows = [
        "| variant | params | emb_dim | FFN width | heads | kv heads | layers | vocab | max positions | rope_theta "
        "| rope scaling | norm eps | tied embeddings | experts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        c = get_model_config(name)
        scaling = (c.rope_scaling or {}).get("factor")
        rows.append(
            f"| `{name}` | {count_params(c) / 1e9:.3f}B | {c.emb_dim} | {_width(c)} | {c.nheads} "
            f"| {c.kvheads or c.nheads} | {c.nlayers} | {c.src_vocab_size} | {context_length(c)} "
            f"| {c.rope_theta:g} | {f'llama3 x{scaling:g}' if scaling else 'none'} | {c.norm_eps:g} "
            f"| {'yes' if c.tie_heads else 'no'} | {_experts(c)} |"
        )
    rows.append("")
    rows.append(
        "params counts every expert; FFN width is a dense layer's, or each expert's; experts: how many, and how "
        "many a token is routed to (`--moe_experts`, `--moe_top_k`)."
    )
    rows.append("")
    rows.append("Aliases: " + ", ".join(f"`{a}` = `{v}`" for a, v in ALIASES.items()) + ".")
    rows.append("")
    rows.append(
        "A Hugging Face `--ckpt_load_path` is checked against these at start-up: its shapes (emb_dim to vocab), "
        "`rope_theta` and `rope_scaling` (`--rope_theta`, `--rope_scaling_factor`), `rms_norm_eps` (`--norm_eps`), "
        "`max_position_embeddings` (`--max_position_embeddings`) and `tie_word_embeddings`; a field that differs "
        "is refused in one line naming both values and the flag that makes them agree. Its `bos_token_id` and "
        "`eos_token_id` are carried into the run's Hugging Face exports; a `--bos_token` other than its "
        "`bos_token_id` is refused, and one not given, or an `--eos_token` other than its `eos_token_id`, gets a "
        "start-up note."
    )
    return "\n".join(rows)


def faults_table() -> str:
    from test_faults import troubleshooting_table

    return troubleshooting_table()


def composition_table() -> str:
    from composition import cases_table, table

    return table() + "\n\n" + cases_table()


def errors_tables() -> str:
    from error_cases import troubleshooting_tables

    return troubleshooting_tables()


def headline(path: Path) -> str:
    """What a module does, from its docstring: the first sentence, up to its first colon."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s+(?=[A-Z`(-])|$)", text)
    sentence = text[: end.start()] if end else text
    depth = 0
    for i, c in enumerate(sentence):  # up to the first colon outside parentheses
        depth += {"(": 1, ")": -1}.get(c, 0)
        if c == ":" and depth == 0 and sentence[i + 1 : i + 2] in (" ", ""):
            return sentence[:i]
    return sentence.rstrip(".")


def modules_table() -> str:
    """The README's map of the package: each top module, and each folder with its modules, in a line each
    from the module docstrings (tests/test_docs.py fails when it drifts from them)."""
    package = ROOT / "fms_fsdp"
    rows = ["| where | what |", "|---|---|"]
    rows += [
        f"| `fms_fsdp/{p.name}` | {headline(p)} |" for p in sorted(package.glob("*.py")) if p.name != "__init__.py"
    ]
    for init in sorted(package.glob("*/**/__init__.py")):
        folder = init.parent
        modules = [f"`{p.name}` ({headline(p)})" for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
        where = folder.relative_to(ROOT).as_posix()
        rows.append(f"| `{where}/` | {headline(init)}: " + "; ".join(modules) + " |")
    return "\n".join(rows)


# each generated document (its path in the repository), and its sections
DOCS: dict[str, dict[str, Callable[[], str]]] = {
    "docs/configuration.md": {
        "flags": markdown_reference,
        "variants": variants_table,
        "composition": composition_table,
    },
    "docs/troubleshooting.md": {"faults": faults_table, "errors": errors_tables},
    "README.md": {"modules": modules_table},
}


def render(name: str, text: str) -> str:
    """The text of the document `name` with each generated section (between its markers) replaced by its
    current content."""
    for key, make in DOCS[name].items():
        begin, end = f"<!-- {key}:begin (generated by scripts/gen_docs.py) -->", f"<!-- {key}:end -->"
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{make()}\n{end}{tail}"
    return text


# what docs/lr_schedules.png draws: a title and the flags of each panel's schedules
SCHEDULE_PLOTS = {
    "--lr_schedule (warmup 100 of 1000 steps, min_lr_ratio 0.1)": {
        name: [f"--lr_schedule={name}"] for name in ("cosine", "linear", "inv_sqrt", "inv", "wsd", "constant")
    },
    "--lr_cycles=3 (each cycle warms up again)": {
        name: [f"--lr_schedule={name}", "--lr_cycles=3"] for name in ("cosine", "linear", "wsd")
    },
    "--lr_cycle_ends=200,500 --lr_rewarmup=0 (Levanter's)": {
        name: [f"--lr_schedule={name}", "--lr_cycle_ends=200,500", "--lr_rewarmup=0"] for name in ("cosine", "inv")
    },
}


def plot_lr_schedules(path: Path) -> None:
    """Every schedule's multiplier of --learning_rate over 1000 steps, computed by schedule.py."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SCHEDULE_PLOTS), figsize=(15, 3.6), sharey=True)
    for ax, (title, schedules) in zip(axes, SCHEDULE_PLOTS.items()):
        for name, flags in schedules.items():
            f = lr_multiplier(schedule_of(parse_args(["--num_steps=1000", "--warmup_steps=100", *flags])))
            ax.plot(range(1000), [f(x) for x in range(1000)], label=name)
        ax.set(title=title, xlabel="step")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("learning rate / --learning_rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    for name in DOCS:
        doc = ROOT / name
        doc.write_text(render(name, doc.read_text()))
        print(f"wrote {doc}")
    try:
        plot_lr_schedules(ROOT / "docs" / "lr_schedules.png")
        print(f"wrote {ROOT / 'docs' / 'lr_schedules.png'}")
    except ImportError:
        print("docs/lr_schedules.png not drawn: pip install matplotlib")
