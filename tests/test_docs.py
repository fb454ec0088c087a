"""The docs against the code (issue 30): README.md and docs/ link only to files and headings that exist, mention only
flags some command accepts, show commands of ours that parse; docs/reference.md is what its generator writes now
and agrees with every numbered script's real --help; ``run_all.sh --print-recipe two-node`` prints commands the
stages and torchrun accept. Fast: no server, no model; each door's --help runs in this process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")

# Flags of other tools the docs mention, by tool (checked against each tool's own docs or --help, not ours). A flag
# mentioned in the docs must be one of ours (collected from our commands below) or listed here.
EXTERNAL_FLAGS = {
    "vllm serve": {"--tensor-parallel-size", "--reasoning-parser", "--enable-auto-tool-choice", "--tool-call-parser",
                   "--max-model-len", "--gpu-memory-utilization", "--trust-remote-code", "--host", "--port",
                   "--api-key", "--hf-token", "--speculative-config", "--kv-transfer-config", "--dtype",
                   "--no-enable-prefix-caching", "--enforce-eager", "--model", "--served-model-name",
                   "--per-request-spec-decode-metrics", "--kv-cache-memory-bytes", "--load-format",
                   "--max-num-batched-tokens", "--max-num-seqs", "--no-enable-chunked-prefill"},
    "torchrun": {"--standalone", "--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"},
    "speculators 0.9.0": {"--data-path", "--hidden-states-backend", "--noise-std", "--verifier-name-or-path",
                          "--hidden-states-path", "--target-layer-ids", "--total-seq-len", "--epochs", "--lr",
                          "--scheduler-warmup-ratio", "--weight-decay", "--loss-fn", "--ttt-steps",
                          "--draft-vocab-size", "--d2t-path", "--t2d-path", "--max-steps", "--checkpoint-freq",
                          "--log-freq", "--logger", "--no-resume-from-checkpoint", "--from-pretrained", "--save-best",
                          "--save-path", "--block-size", "--max-anchors", "--mask-token-id", "--dflash-decay-gamma",
                          "--endpoint", "--concurrency", "--max-tokens", "--temperature", "--limit"},
    "specforge train": {"--config"},  # the rest is its YAML's keys (docs/naming.md), no flags
    "pytest": {"--durations"},
    "pip": {"--index-url", "--no-deps"},  # making the vLLM 0.34 interpreter by hand (docs/development.md)
    "tensorboard": {"--logdir"},
}

SCRIPTS = {"01_prepare_data.py": "prepare", "01b_generate_synthetic.py": "generate",
           "02_extract_hidden_states.py": "extract", "03_build_vocab_mapping.py": "vocab", "04_train.py": "train",
           "05_evaluate.py": "evaluate"}


def door_help(script: str) -> str:
    """``python <script> --help`` as the door prints it, run in this process (COLUMNS 100, as the reference)."""
    out = io.StringIO()
    old_argv, old_cols = sys.argv, os.environ.get("COLUMNS")
    sys.argv, os.environ["COLUMNS"] = [script, "--help"], "100"
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        assert e.value.code in (0, None)
    finally:
        sys.argv = old_argv
        if old_cols is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = old_cols
    return out.getvalue()


def shell_flags(path: str) -> set[str]:
    """The flags a shell script's option loop accepts: its case patterns (``--from)``, ``--check|--plan)``)."""
    flags = set()
    for line in (ROOT / path).read_text().splitlines():
        m = re.match(r"\s*((?:-[-\w]+\|?)+)\)", line)
        if m:
            flags |= {f for f in m.group(1).split("|") if f.startswith("--")}
    return flags


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    from eagle3pipe.reference import MODULES, module_help

    out = {script: door_help(script) for script in SCRIPTS}
    out.update({f"eagle3pipe.{m}": module_help(m) for m in MODULES})
    return out


@pytest.fixture(scope="module")
def our_flags(helps) -> dict[str, set[str]]:
    # the usage block only (up to the first blank line): the options themselves, not flags their descriptions cite
    out = {name: set(FLAG.findall(text.split("\n\n", 1)[0])) for name, text in helps.items()}
    for path in ("run_all.sh", "scripts/setup_env.sh", "test.sh", "demo.sh"):
        out[path] = shell_flags(path)
    # the bench scripts (BENCHMARKS.md's commands): their argparse flags, read from the source (importing them would
    # load vLLM or CUDA code)
    out["bench/"] = {f for p in sorted((ROOT / "bench").glob("*.py"))
                     for f in re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", p.read_text())}
    assert {"--bare-tokens", "--part"} <= out["bench/"]
    assert "--print-recipe" in out["run_all.sh"] and "--check-gpu-pins" in out["scripts/setup_env.sh"]
    assert "--no-thinking" in out["01_prepare_data.py"]  # a boolean flag's negative form
    return out


# ---------------------------------------------------------------------------------------------------------------
# Links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped but - and _, spaces to dashes."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose(path: Path) -> str:
    """The file without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)


def anchors(path: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", prose(path), flags=re.M)}


def test_docs_exist_and_readme_is_short():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    for page in ("install", "quickstart-k25", "two-node", "online", "warm-starts", "dflash", "sizing", "operations",
                 "naming", "development", "reference", "stages/01_prepare", "stages/01b_generate",
                 "stages/02_extract", "stages/03_vocab", "stages/04_train", "stages/05_evaluate"):
        assert f"docs/{page}.md" in names, page
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    first_screen = "\n".join(readme.splitlines()[:40])
    # a newcomer's first screen: the K2.5 command, the GPU install, what has run where
    assert "./run_all.sh --config configs/kimi_k25.yaml" in first_screen
    assert "scripts/setup_env.sh --gpu" in first_screen and "## What has run where" in first_screen
    assert "./test.sh" in readme and "./test.sh" in (ROOT / ".ci/run").read_text()


def test_every_relative_link_resolves():
    bad = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc)):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not bad, "\n".join(bad)


def test_the_link_check_catches_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A title (with `code`)\n\n```bash\n# not a heading\n```\n")
    assert anchors(page) == {"a-title-with-code"}
    assert slug("run_all.sh: check, plan, status, run") == "run_allsh-check-plan-status-run"


# ---------------------------------------------------------------------------------------------------------------
# Flags


def test_every_flag_mentioned_exists(our_flags):
    known = set().union(*our_flags.values(), *EXTERNAL_FLAGS.values())
    bad = sorted({f"{doc.relative_to(ROOT)}: {flag}" for doc in DOCS for flag in FLAG.findall(doc.read_text())
                  if flag not in known})
    assert not bad, "flags no command of ours accepts and no listed tool has:\n" + "\n".join(bad)


def test_external_flags_are_not_ours(our_flags):
    """A flag listed as another tool's must not hide a misspelt flag of ours: the lists stay the other tools'."""
    ours = set().union(*our_flags.values())
    for tool in ("torchrun", "specforge train"):
        clash = EXTERNAL_FLAGS[tool] & ours - {"--resume", "--learning-rate", "--concurrency", "--temperature",
                                               "--epochs", "--max-steps", "--config",
                                               "--nproc-per-node"}  # ours too (train.nproc_per_node)
        assert not clash, (tool, clash)


def commands(doc: Path) -> list[str]:
    """The logical lines of a doc's fenced code blocks (continuations joined, comments dropped)."""
    out = []
    for block in re.findall(r"^```(?:bash|sh)\n(.*?)^```", doc.read_text(), flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            out.append(line)
    return out


def _words(line: str) -> list[str] | None:
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return None  # a quoted JSON spanning what the doc cut


def check_command(words: list[str], our_flags) -> str | None:
    """None when a command line of ours parses with its command's own parser, else why not."""
    from eagle3pipe.config import build_parser

    for i, w in enumerate(words):
        name = Path(w).name
        if name in SCRIPTS:
            args = [a for a in words[i + 1:] if a not in (">", "2>&1", "&") and not a.endswith(".out")]
            if any(a.startswith("<") or "..." in a for a in args):
                return None
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    build_parser(SCRIPTS[name], None).parse_args(args)
            except SystemExit:
                return f"{name} refuses {args}"
            return None
        if name == "run_all.sh" or w.startswith("eagle3pipe."):
            key = "run_all.sh" if name == "run_all.sh" else w
            if key not in our_flags:
                return f"no command {key}"
            unknown = [a for a in words[i + 1:] if a.startswith("--") and a.split("=")[0] not in our_flags[key]]
            return f"{key} has no {unknown}" if unknown else None
    return None


def test_every_command_of_ours_in_the_docs_parses(our_flags):
    bad, checked = [], 0
    for doc in DOCS:
        for line in commands(doc):
            words = _words(line)
            if not words:
                continue
            why = check_command(words, our_flags)
            checked += any(Path(w).name in SCRIPTS or Path(w).name == "run_all.sh" for w in words)
            if why:
                bad.append(f"{doc.relative_to(ROOT)}: {why}\n    {line.strip()}")
    assert checked > 20 and not bad, "\n".join(bad)


def test_the_command_check_catches_a_wrong_flag(our_flags):
    assert check_command(shlex.split("python 04_train.py --config c.yaml --learning-rate 1e-4"), our_flags) is None
    assert "refuses" in check_command(shlex.split("python 04_train.py --lr 1e-4"), our_flags)
    assert "has no" in check_command(shlex.split("./run_all.sh --config c --stats"), our_flags)


# ---------------------------------------------------------------------------------------------------------------
# The generated reference


def test_reference_is_what_the_generator_writes():
    from eagle3pipe.reference import REFERENCE, generate

    assert REFERENCE.read_text() == generate(), "docs/reference.md is stale: run python -m eagle3pipe.reference"


def test_reference_agrees_with_each_scripts_help(helps):
    """Each door's real --help and the reference name the same flags with the same descriptions."""
    import dataclasses

    from eagle3pipe.config import SECTIONS, cli_flag, shown_default, field_docs
    from eagle3pipe.reference import script_sections

    reference = (ROOT / "docs/reference.md").read_text()

    def norm(text: str) -> str:  # argparse wraps lines, also after a hyphen
        return re.sub(r"\s+", " ", re.sub(r"(?<=\w-)\n\s*", "", text))

    for script, stage in SCRIPTS.items():
        text = norm(helps[script])
        flags = set(FLAG.findall(helps[script].split("\n\n", 1)[0]))  # the usage block: every option
        listed = {"--config"}
        for section, names in script_sections(stage):
            fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
            for name in names:
                flag, doc = cli_flag(name), field_docs(SECTIONS[section])[name]
                listed |= {flag, "--no-" + flag[2:]} & flags or {flag}
                row = f"| `{section}.{name}` | "
                assert row in reference, (script, row)
                line = next(x for x in reference.splitlines() if x.startswith(row))
                cell = doc.replace("|", "\\|").replace("<", "&lt;")  # as a markdown table cell
                assert cell in line and f"`{shown_default(fields[name])}`" in line, line
                assert norm(f"{doc} (default: {shown_default(fields[name])})") in text, (script, flag)
        assert flags == listed, (script, flags ^ listed)


# ---------------------------------------------------------------------------------------------------------------
# run_all.sh --print-recipe two-node


def _config(tmp_path: Path, **train) -> Path:
    cfg = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    cfg["shared"]["data_dir"] = str(tmp_path / "data")
    cfg["shared"]["verifier"] = str(ROOT / cfg["shared"]["verifier"])
    cfg.setdefault("train", {}).update(train)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


TORCHRUN = ".venv/bin/python -m torch.distributed.run "  # the project's environment runs torchrun
VLLM_SERVE = "vllm.entrypoints.cli.main serve"  # `vllm serve`, run by the vLLM environment's interpreter


def _recipe_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_two_node_recipe_commands_parse_for_the_config(tmp_path, monkeypatch):
    import torch.distributed.run as torchrun

    from eagle3pipe.config import build_parser
    from eagle3pipe.recipe import two_node
    from eagle3pipe.records import DataDir

    monkeypatch.setenv("VLLM_API_KEY", "s3cret-key")
    config = _config(tmp_path)
    text = two_node(str(config), ("gpu-a", "gpu-b"))
    assert "s3cret-key" not in text
    lines = _recipe_lines(text)
    by_stage = {}
    for line in lines:
        words = shlex.split(line)
        if words[0] == ".venv/bin/python" and words[1] in SCRIPTS:  # the project's environment runs our stages
            by_stage[SCRIPTS[words[1]]] = build_parser(SCRIPTS[words[1]], None).parse_args(words[2:])
    assert set(by_stage) == set(SCRIPTS.values()) - {"train"}  # 04 runs under torchrun, below
    assert getattr(by_stage["generate"], "shared.vllm_url") == ["http://gpu-a:8000", "http://gpu-b:8000"]
    assert getattr(by_stage["extract"], "extract.extract_url") == ["http://gpu-a:8000", "http://gpu-b:8000"]
    assert all(getattr(a, "config") == str(config) for a in by_stage.values())
    # the extraction servers: reachable from the other node, key required, writing into the shared data dir
    serve = [shlex.split(x) for x in lines if VLLM_SERVE in x and "--kv-transfer-config" in x]
    assert len(serve) == 1
    words = serve[0]
    assert words[words.index("--host") + 1] == "0.0.0.0" and words[words.index("--api-key") + 1] == "$VLLM_API_KEY"
    kv = json.loads(words[words.index("--kv-transfer-config") + 1])
    assert Path(kv["kv_connector_extra_config"]["shared_storage_path"]) == DataDir(tmp_path / "data").hs_work.resolve()
    servers = [line for line in lines if VLLM_SERVE in line]
    assert len(servers) == 2  # 01b's and 02's, each run by the vLLM environment's interpreter (.venv has no vLLM)
    for line in servers:  # with flags vLLM has (the list above)
        assert set(FLAG.findall(line)) <= EXTERNAL_FLAGS["vllm serve"], line
        assert re.search(rf"(^|\s)\S*python -m {VLLM_SERVE} ", line), line
    # 04 offline: one torchrun command for both nodes, rendezvous on node 0
    train = [shlex.split(x) for x in lines if x.startswith(TORCHRUN)]
    assert len(train) == 1
    args = torchrun.get_args_parser().parse_args(train[0][3:])
    assert (args.nnodes, args.rdzv_endpoint, args.training_script) == ("2", "gpu-a:29500", "04_train.py")
    build_parser("train", None).parse_args(args.training_script_args)


def test_two_node_recipe_online_trains_on_node_1_from_node_0s_server(tmp_path):
    import torch.distributed.run as torchrun

    from eagle3pipe.config import build_parser
    from eagle3pipe.recipe import two_node

    text = two_node(str(_config(tmp_path, data_source="online")), ("n0", "n1"))
    lines = _recipe_lines(text)
    assert not any("02_extract_hidden_states.py" in x for x in lines)  # online: no hidden_states/ to write
    (train,) = [shlex.split(x) for x in lines if x.startswith(TORCHRUN)]
    args = torchrun.get_args_parser().parse_args(train[3:])
    assert args.standalone and args.training_script == "04_train.py"
    parsed = build_parser("train", None).parse_args(args.training_script_args)
    assert getattr(parsed, "extract.extract_url") == ["http://n0:8000"]
    assert "node 1" in text.split(f"{TORCHRUN}--standalone")[0].rsplit("##", 1)[1]


def test_run_all_print_recipe_prints_the_modules_recipe(tmp_path):
    config = _config(tmp_path)
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("VLLM_API_KEY", None)
    r = subprocess.run([str(ROOT / "run_all.sh"), "--config", str(config), "--print-recipe", "two-node", "--nodes",
                        "a,b"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    from eagle3pipe.recipe import two_node

    assert r.stdout == two_node(str(config), ("a", "b"))
    assert not (tmp_path / "data").exists()  # printed only: nothing ran
    from eagle3pipe.recipe import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:  # what run_all.sh passes it, in-process
        main(["three-node", "--config", str(config)])
    assert e.value.code == 2 and "two-node" in err.getvalue()
    assert main(["two-node", "--config", str(config), "--nodes", "only-one"]) == 2


def test_the_published_wall_clock_figures_on_05s_page_are_the_anchor_table():
    """Issue 46: 05's page quotes the published wall-clock speedups from the one table 05's report uses
    (eagle3pipe/anchors.py WALL_CLOCK): each entry is a row of the page's table, with its draft, target, concurrency
    and speedup, and the page has no row the table lacks."""
    from eagle3pipe.anchors import WALL_CLOCK

    page = (ROOT / "docs" / "stages" / "05_evaluate.md").read_text()
    start = page.index("| draft | target | concurrency | speedup | settings |")
    lines = page[start:].splitlines()[2:]  # after the header and its separator, to the table's end
    rows = lines[: next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [(c[0], c[1], int(c[2]), float(c[3])) for c in cells] == \
        [(a.draft, a.target, a.concurrency, a.speedup) for a in WALL_CLOCK]
    for c, a in zip(cells, WALL_CLOCK):  # the settings cell names the engine and, where given, the lengths
        assert a.engine in c[4] or a.engine == "not stated", c
        if a.output_tokens:
            assert f"{a.input_tokens} in / {a.output_tokens} out" in c[4], c


def test_every_log_a_page_names_is_one_a_stage_writes():
    """Issue 47: the pages named logs/02_extract.log while 02 wrote logs/02_extract_hidden_states.log. Every
    logs/NAME.log in the pages and the doors' docstrings is a stage's log (run_all's stage names, which the doors
    pass to cli.run_stage: test_run_all.py), a rank's or 04_export's, run_all's own, or a server log a stage starts."""
    from eagle3pipe.records import DataDir
    from eagle3pipe.run_all import STAGES

    dd = DataDir(Path("/d"))
    written = {dd.log_file(n).name for n, _, _ in STAGES} | {"04_train.rankN.log", "04_export.log", "run_all.log",
                                                             "01b_vllm_server.log", "02_vllm_server.log",
                                                             dd.eval_server_log("draft").name}
    patterns = {"<stage>.log", "05_*.log", "05_vllm_*.log"}
    texts = [p.read_text() for p in DOCS] + [p.read_text() for p in sorted(ROOT.glob("0*.py"))] + \
        [(ROOT / "run_all.sh").read_text()]
    named = {m for text in texts for m in re.findall(r"logs/([\w<>.*-]+\.log)", text)}
    assert "02_extract.log" in named and not named - written - patterns, named - written - patterns
    for source in ("eagle3pipe/extract_vllm.py", "eagle3pipe/generate.py"):  # the servers' logs, as the code names them
        assert re.search(r'"(0\w+_vllm_server\.log)"', (ROOT / source).read_text()).group(1) in written


def test_the_recipe_prints_from_a_login_node_with_the_verifier_s_config_json_alone(tmp_path):
    """Issue 47: the recipe needed the verifier folder (547 GB for K2.5) to print anything. On a node without it,
    --verifier-config (a copy of its config.json) gives the layer count, and the commands name the verifier's path
    on the GPU nodes; without either, one error line says which flag to pass."""
    from eagle3pipe.recipe import main, two_node

    config = _config(tmp_path)
    folder = yaml.safe_load(config.read_text())["shared"]["verifier"]
    copy = tmp_path / "config.json"
    copy.write_text((Path(folder) / "config.json").read_text())
    layers = json.loads(copy.read_text())["num_hidden_layers"]
    raw = yaml.safe_load(config.read_text())
    raw["shared"]["verifier"] = "/models/not-on-this-node"
    config.write_text(yaml.safe_dump(raw))
    text = two_node(str(config), ("a", "b"), str(copy))
    (serve,) = [shlex.split(x) for x in _recipe_lines(text) if "--kv-transfer-config" in x]
    assert "/models/not-on-this-node" in serve
    spec = json.loads(serve[serve.index("--speculative-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"][-1] == layers  # the final id
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["two-node", "--config", str(config)]) == 2
    assert "--verifier-config" in err.getvalue()


def test_every_config_key_a_page_or_a_help_names_exists(helps):
    """Issue 47: every --help (and the reference) named train.aux_layer_ids, a key the config refuses (the key is
    train.draft_layer_ids). Every `section.key` in the pages, the doors' and modules' --help, run_all.sh's help and
    the config's own comments is a field of that section (or one of its subkeys)."""
    import dataclasses

    from eagle3pipe.config import SECTIONS

    fields = {s: {f.name for f in dataclasses.fields(c)} for s, c in SECTIONS.items()}
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in DOCS}
    texts.update(helps)
    texts["run_all.sh"] = (ROOT / "run_all.sh").read_text()
    texts["eagle3pipe/config.py"] = (ROOT / "eagle3pipe/config.py").read_text()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        texts[str(path.relative_to(ROOT))] = path.read_text()
    FILE_SUFFIXES = {"out", "log", "txt", "py", "md", "yaml", "json", "jsonl"}  # prepare.out is a file, not a key
    key = re.compile(rf"(?<![\w./-])({'|'.join(SECTIONS)})\.([a-z][a-z0-9_]*)(?![\w(])")
    bad = sorted({f"{name}: {m.group(1)}.{m.group(2)}" for name, text in texts.items() for m in key.finditer(text)
                  if m.group(2) not in fields[m.group(1)] | FILE_SUFFIXES})
    assert not bad, "config keys that do not exist:\n" + "\n".join(bad)
    assert key.search("reads the subset train.aux_layer_ids names").group(2) not in fields["train"]  # would be caught


def test_what_the_pages_say_of_vllm_versions_and_the_k25_serve_command_holds():
    """Issue 47: install.md called 0.32/0.33 the proven versions, "others refused", while the connector accepts 0.26
    to 0.33 (vllm_internals.SUPPORTED_VLLM_MINORS) and only 0.26.0 ran on a GPU; the serve commands for K2.5 left out
    --tensor-parallel-size 8 and --trust-remote-code; one published draft had two local paths. Every range of
    accepted vLLM versions a page or setup_env.sh states is the connector's; no page calls 0.33 or the --gpu install
    proven on a GPU; every `vllm serve` of the K2.5 folder names both flags; one local path per published draft."""
    from eagle3pipe.vllm_internals import SUPPORTED_VLLM_MINORS

    (_, lo), (_, hi) = SUPPORTED_VLLM_MINORS[0], SUPPORTED_VLLM_MINORS[-1]
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in DOCS}
    texts["scripts/setup_env.sh"] = (ROOT / "scripts/setup_env.sh").read_text()
    ranges = {(name, m.group(0)) for name, text in texts.items()
              for m in re.finditer(r"0\.(\d\d)(?:\.x)? ?(?:to|-) ?0\.(\d\d)(?:\.x)?(?=[\s):;,.]|$)", text)
              if re.search(r"accepts|refuses other|connector", text[max(0, m.start() - 120):m.end() + 60])}
    assert ranges, "no page states the accepted range"
    assert "README.md" in {name for name, _ in ranges}
    assert all(re.fullmatch(rf"0\.{lo}(\.x)? ?(to|-) ?0\.{hi}(\.x)?", r) for _, r in ranges), ranges
    for name, text in texts.items():
        assert not re.search(r"(0\.3[23]|--gpu)[^.\n]{0,60}\bproven\b", text), name
    serves = [(name, line) for name, text in texts.items() for line in text.replace("\\\n", " ").splitlines()
              if re.search(r"vllm serve /models/Kimi-K2\.5\b", line) and "--speculative-config" in line
              and "extract_hidden_states" not in line]
    assert serves and all("--tensor-parallel-size 8" in line and "--trust-remote-code" in line
                          for _, line in serves), serves
    paths = {m for text in texts.values() for m in re.findall(r"/models/[\w.-]*eagle3[\w.-]*", text)}
    k2 = {p for p in paths if "k2-" in p.lower() or p.lower().endswith("k2-eagle3")}  # AQ-MedAI's K2 draft
    assert k2 == {"/models/Kimi-K2-Instruct-eagle3"}, paths  # one name (its Hugging Face one)
    assert all(p.lower().removeprefix("/models/") in {"kimi-k2-instruct-eagle3", "kimi-k2.5-eagle3-mla",
                                                      "kimi-k2.5-eagle3", "kimi-k2.6-eagle3-mla"} for p in paths), paths


def test_the_anchor_figures_on_05_s_page_are_the_report_s_table():
    """Issue 47: 05's report printed AQ-MedAI figures from a file outside the repository that its own page said
    differ from the model card. The page's table of published figures is eagle3pipe/anchors.py's, row by row (the
    report's source: test_evaluate.py), each anchor with a source and settings."""
    from eagle3pipe.anchors import ANCHORS

    page = (ROOT / "docs/stages/05_evaluate.md").read_text()
    sets = ("mtbench", "gsm8k", "humaneval", "math500")
    rows = {}
    for line in page.splitlines():
        m = re.match(r"^\| \[([\w./-]+)\]\(https://huggingface\.co/\1\)", line)
        if m:
            cells = [c.strip() for c in line.split("|")[2:7]]  # k, then the four sets
            rows[m.group(1)] = (int(cells[0]), {s: float(v) for s, v in zip(sets, cells[1:]) if v})
    assert rows == {a.draft: (a.k, a.acceptance_length) for a in ANCHORS}
    assert all(a.source.startswith("its model card") and a.settings for a in ANCHORS)
    assert "2.39" not in page and "3.27 " not in page  # the other source's AQ-MedAI row is gone from the page
