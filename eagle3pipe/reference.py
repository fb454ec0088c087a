"""Write docs/reference.md, the CLI and config reference, from the config's field comments and the tools' --help.

    python -m eagle3pipe.reference            # rewrite docs/reference.md
    python -m eagle3pipe.reference --check    # exit 1 when docs/reference.md differs from what would be written

The config part is read from ``config.SECTIONS`` and ``config.field_docs`` (the comment on each field), the same
source every stage's ``--help`` prints, so the reference cannot drift from the flags: ``tests/test_docs.py`` checks
the committed file against this generator and against each numbered script's real ``--help``. The other commands'
parts are their own ``--help`` texts (argparse, formatted at 100 columns) and ``run_all.sh``'s usage header.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import re
import sys
import typing
from pathlib import Path

from .config import BORROWED_FLAGS, SECTIONS, VllmArgs, field_types, cli_flag, shown_default, field_docs
from .records import atomic_write_bytes

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference.md"
HELP_COLUMNS = "100"  # argparse wraps --help to $COLUMNS: fixed so the text does not depend on the terminal

# numbered script -> the config section (stage) its door passes to cli.run_stage
SCRIPTS = {
    "01_prepare_data.py": "prepare",
    "01b_generate_synthetic.py": "generate",
    "02_extract_hidden_states.py": "extract",
    "03_build_vocab_mapping.py": "vocab",
    "04_train.py": "train",
    "05_evaluate.py": "evaluate",
}
# modules with a command line of their own (python -m eagle3pipe.NAME --help), in the order the docs meet them
MODULES = ["doctor", "costs", "status", "recipe", "extract_vllm", "toy", "toy_reasoning", "reference"]
SHELL_SCRIPTS = ["run_all.sh", "scripts/setup_env.sh", "test.sh", "demo.sh"]


def script_sections(stage: str) -> list[tuple[str, list[str]]]:
    """(section, field names) a stage's door takes as flags: shared, its own section, and borrowed fields."""
    out = [("shared", [f.name for f in dataclasses.fields(SECTIONS["shared"])]),
           (stage, [f.name for f in dataclasses.fields(SECTIONS[stage])])]
    borrowed: dict[str, list[str]] = {}
    for section, name in BORROWED_FLAGS.get(stage, []):
        borrowed.setdefault(section, []).append(name)
    return out + list(borrowed.items())


def _type_name(typ) -> str:
    if typ is VllmArgs:
        return "vLLM flags"
    if typing.get_origin(typ) is list:
        return f"list of {typing.get_args(typ)[0].__name__}"
    return typ.__name__


def _flag_cell(name: str, typ) -> str:
    return f"`{cli_flag(name)}` / `--no-{name.replace('_', '-')}`" if typ is bool else f"`{cli_flag(name)}`"


def _cell(text: str) -> str:
    """A description as a table cell: a pipe would end the cell, and "<think>" would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def section_table(section: str) -> list[str]:
    cls = SECTIONS[section]
    docs, types_ = field_docs(cls), field_types(cls)
    flagged = section != "plan"  # no stage reads plan: YAML only (run_all.sh --plan)
    head = "| key | flag | type | default | description |" if flagged else "| key | type | default | description |"
    rows = [head, "| --- " * (5 if flagged else 4) + "|"]
    for f in dataclasses.fields(cls):
        cells = [f"`{section}.{f.name}`"] + ([_flag_cell(f.name, types_[f.name])] if flagged else [])
        cells += [_type_name(types_[f.name]), f"`{shown_default(f)}`", _cell(docs[f.name])]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


@contextlib.contextmanager
def _help_columns():
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old


def module_help(name: str) -> str:
    """``python -m eagle3pipe.<name> --help`` as printed, run in this process."""
    mod = importlib.import_module(f"eagle3pipe.{name}")
    out = io.StringIO()
    argv0 = sys.argv[0]
    sys.argv[0] = f"python -m eagle3pipe.{name}"  # argparse names the program (and wraps usage) after argv[0]
    try:
        with _help_columns(), contextlib.redirect_stdout(out):
            try:
                mod.main(["--help"])
            except SystemExit:
                pass
    finally:
        sys.argv[0] = argv0
    return out.getvalue().rstrip() + "\n"


def shell_usage(path: str) -> str:
    """The comment header of a shell script (what ``run_all.sh --help`` prints), without the shebang."""
    lines = []
    for line in (REPO / path).read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        lines.append(re.sub(r"^# ?", "", line))
    return "\n".join(lines).rstrip() + "\n"


def generate() -> str:
    out = ["# CLI and config reference", "",
           "Generated by `python -m eagle3pipe.reference` from the comment on each field of `eagle3pipe/config.py` "
           "(the text every numbered script's `--help` prints) and from the other commands' own `--help`. Do not "
           "edit by hand: `tests/test_docs.py` fails when this file differs from the generator's output.", "",
           "Every numbered script takes `--config FILE.yaml` and one flag per key of the sections below "
           "(`max_completion_tokens` -> `--max-completion-tokens`); precedence: flag > YAML > default. A YAML file "
           "has one section per table (`shared:`, `prepare:`, ...); unknown keys and wrong types are refused at "
           "start, naming the key. Lists take several values (`--aux-layer-ids 2 30 58`) or a repeated flag "
           "(`--vllm-url A --vllm-url B`); `vLLM flags` take one string split as a shell would "
           "(`--server-args \"--tensor-parallel-size 8\"`, repeatable) or a YAML list.", "",
           "## Which script takes which section", "",
           "| script | flags of the sections |", "| --- | --- |"]
    for script, stage in SCRIPTS.items():
        parts = [s if s in ("shared", stage) else f"{s} ({', '.join(f'`{cli_flag(n)}`' for n in names)})"
                 for s, names in script_sections(stage)]
        out.append(f"| `{script}` | {', '.join(f'[{p}](#{p})' if ' ' not in p else p for p in parts)} |")
    out += ["| `run_all.sh` | `--config` (passed to every stage) and its own options: [run_all.sh](#run_allsh) |", ""]
    for section in SECTIONS:
        out += [f"## {section}", ""]
        if section == "plan":
            out += ["Read by `run_all.sh --plan` and `--check` (`eagle3pipe/costs.py`); no stage reads it, so it has "
                    "no flags: set it in YAML.", ""]
        out += section_table(section) + [""]
    out += ["## Other commands", "", "### run_all.sh", "", "```text", shell_usage("run_all.sh").rstrip(), "```", ""]
    for name in MODULES:
        out += [f"### python -m eagle3pipe.{name}", "", "```text", module_help(name).rstrip(), "```", ""]
    out += ["### scripts/setup_env.sh", "", "```text", shell_usage("scripts/setup_env.sh").rstrip(), "```", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write docs/reference.md (the CLI and config reference) from the "
                                            "config's field comments and each command's --help.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/reference.md is stale")
    p.add_argument("--out", type=Path, default=REFERENCE, help="file to write (default: docs/reference.md)")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"error: {args.out} is not what `python -m eagle3pipe.reference` writes now: rerun it",
                  file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out, text.encode())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
