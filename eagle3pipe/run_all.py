"""The plan behind ``run_all.sh``: which stage scripts run, with which extra flags, and each one's config hash.

``run_all.sh`` (bash, so it survives ``nohup`` and shows plain lines in ``tail -f``) asks this module for a plan::

    python -m eagle3pipe.run_all plan --config FILE [--vllm-url URL]

and gets one tab-separated line per stage: ``name script hash marker started log config launcher resume extra``
(``launcher``: ``-`` for the plain interpreter, else the module and flags run with ``python -m``: torchrun for 04
when ``train.nproc_per_node`` resolves to more than one process; ``resume``: ``-``, or the flags that make the
stage continue an interrupted run). A stage's hash covers
the config sections it and every stage before it read, so changing an upstream setting re-runs everything after
it; where the data goes to or comes from (``shared.vllm_url``, ``shared.progress_every_s``) is left out, so a demo
server on a new port does not redo finished work. Before the first stage starts, ``check --stages ...`` runs the
config checks of every stage run_all will run (``check_stages``). The marker file (``DataDir.stage_marker``) holds
the hash and is written only after the stage exited 0.

Continuing an interrupted stage: ``run_all.sh`` writes ``DataDir.stage_started`` (the hash) before it starts a
stage and removes it once the stage finished. Every stage but 04 resumes when run again with the same config; 04
refuses to start over an earlier run's checkpoints unless told (``--resume`` or ``--overwrite``). So a 04 that an
earlier run_all started with this very config and that did not finish (a crash, a kill, a lost node) gets
``--resume`` from run_all.sh (``RESUME_FLAGS``): the command run_all printed continues it from its newest
checkpoint, and 04's own checks still refuse checkpoints of other settings or data. A 04 started with another
config, or after an upstream stage ran again, is not resumed by run_all.

01b runs only when a vLLM URL is configured, or ``generate.server_args`` (01b then starts its own server). Without
either, 02/03 read ``synthetic/`` if an earlier 01b finished it
(its provenance says so), else ``prepared/``: the stages then get a resolved copy of the config with
``extract.input: prepared`` (``<data_dir>/run_all/resolved_config.yaml``). Training a thinking model (``thinking:
true``) on prepared/'s human-written answers is refused unless ``--allow-human-answers``: after ``<think>`` the
model writes its own reasoning, never those answers, and a draft trained on them is accepted far less (BENCHMARKS.md:
acceptance length 1.17 vs 2.93 on regenerated answers).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import yaml

from .config import ConfigError, load_config
from .records import DataDir, FormatError, atomic_write_bytes, check_synthetic_finished

# (stage name = its log and lock name, script glob, config section it adds): every door passes its stage name
# to cli.run_stage (test_run_all.py runs each door to check it)
STAGES = [
    ("01_prepare", "01_*.py", "prepare"),
    ("01b_generate", "01b_*.py", "generate"),
    ("02_extract", "02_*.py", "extract"),
    ("03_vocab", "03_*.py", "vocab"),
    ("04_train", "04_*.py", "train"),
    ("05_evaluate", "05_*.py", "evaluate"),
]
HASH_EXCLUDED_SHARED = ("vllm_url", "progress_every_s")  # where, not what: do not redo work when these change
# flags that make a stage continue its interrupted run (the others do so by themselves when run again)
RESUME_FLAGS = {"04_train": ["--resume"]}


def stage_hashes(cfg) -> dict[str, str]:
    """Cumulative config hash per stage (see module docstring)."""
    shared = dataclasses.asdict(cfg.shared)
    for key in HASH_EXCLUDED_SHARED:
        shared.pop(key)
    payload: dict = {"shared": shared}
    out = {}
    for name, _, section in STAGES:
        payload[section] = dataclasses.asdict(getattr(cfg, section))
        out[name] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return out


def train_processes(cfg) -> int:
    """Processes run_all starts for stage 04: train.nproc_per_node, where 0 means every GPU torch sees (1 on CPU,
    or when train.device is cpu)."""
    n = cfg.train.nproc_per_node
    if n == 0:
        if cfg.train.device == "cpu":
            return 1
        import torch

        n = torch.cuda.device_count() or 1
    return n


def train_launcher(cfg) -> list[str]:
    """``python -m`` arguments that start 04 on ``train_processes`` processes of this node (torchrun's own
    single-node rendezvous), or [] for one plain process. Several nodes: ``run_all.sh --print-recipe two-node``
    (docs/two-node.md)."""
    n = train_processes(cfg)
    return ["torch.distributed.run", "--standalone", "--nproc-per-node", str(n)] if n > 1 else []


def find_script(repo: Path, pattern: str) -> Path:
    # "01_*.py" must not match "01b_*.py": the name after the number starts with a letter in both, so filter.
    number = pattern.split("_", 1)[0]
    matches = sorted(p for p in repo.glob(pattern) if p.name.split("_", 1)[0] == number)
    if len(matches) != 1:
        raise ConfigError(f"expected one stage script matching {pattern} in {repo}, found {[m.name for m in matches]}")
    return matches[0]


def _synthetic_finished(dd: DataDir) -> bool:
    try:
        check_synthetic_finished(dd)
    except FormatError:
        return False
    return True


def left_out(cfg, name: str) -> str:
    """Why run_all does not run stage ``name`` for this config, or "" (01b without a server is ``plan``'s call)."""
    if name == "02_extract" and cfg.train.data_source == "online":  # a whole 02 first would spend hours and disk
        return "train.data_source online (04 extracts the states as it trains)"
    return ""


def plan(config_path: str, vllm_url: list[str], repo: Path, allow_human_answers: bool = False) -> list[dict]:
    overrides = {"shared": {"vllm_url": vllm_url}} if vllm_url else None
    cfg = load_config(config_path, overrides)
    has_server = bool(cfg.shared.vllm_url or cfg.generate.server_args)  # a URL, or 01b starts its own server
    extra: dict[str, list[str]] = {name: [] for name, _, _ in STAGES}
    dd = DataDir(cfg.data_dir)
    stage_config = str(Path(config_path).resolve())
    if not has_server and cfg.extract.input != "prepared" and _synthetic_finished(dd):
        print(f"run_all: no vLLM URL; {dd.synthetic} was finished by an earlier 01b: stages read it", file=sys.stderr)
    elif not has_server and cfg.extract.input != "prepared":
        if cfg.shared.thinking and not allow_human_answers:
            raise ConfigError(
                "no vLLM URL (--vllm-url or shared.vllm_url): stage 01b would be skipped and the draft trained on "
                "the datasets' human-written answers. With thinking on, the verifier writes its own reasoning after "
                "<think> and never these answers, so such a draft is rarely accepted (BENCHMARKS.md: acceptance "
                "length 1.17 trained on human answers vs 2.93 on answers the verifier regenerated). Pass --vllm-url "
                "of a server running the verifier (--reasoning-parser kimi_k2), or --allow-human-answers to train "
                "on the human answers anyway")
        # 01b is skipped, so 02 and 03 read stage 01's rows. Stages 03/04 have no --input flag: every stage gets
        # a resolved copy of the config with extract.input = prepared (kept beside the markers, for the record).
        cfg.extract.input = "prepared"
        stage_config = str(dd.stage_marker("resolved_config").with_suffix(".yaml"))
        Path(stage_config).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(stage_config), yaml.safe_dump(cfg.to_dict(), sort_keys=False).encode())
    if vllm_url:
        extra["01b_generate"] = ["--vllm-url", *vllm_url]
    hashes = stage_hashes(cfg)
    rows = []
    for name, pattern, _ in STAGES:
        if name == "01b_generate" and not has_server:
            continue
        if left_out(cfg, name):
            print(f"run_all: stage {name} is not run: {left_out(cfg, name)}", file=sys.stderr)
            continue
        script = find_script(repo, pattern)
        rows.append({"name": name, "script": str(script), "hash": hashes[name], "marker": str(dd.stage_marker(name)),
                     "started": str(dd.stage_started(name)), "log": str(dd.log_file(name)),
                     "extra": extra[name], "config": stage_config,
                     "launcher": train_launcher(cfg) if name == "04_train" else [],
                     "resume": RESUME_FLAGS.get(name, [])})
    return rows


def check_stages(config_path: str, vllm_url: list[str], names: list[str]) -> None:
    """Each stage's own config checks (``PipelineConfig.validate``, what its door runs first), for every stage in
    ``names`` (those run_all is about to run, in their resolved config), before the first one starts: a setting 05
    refuses stops the run now, not after the hours of 01b to 04. Raises ConfigError naming the stage."""
    cfg = load_config(config_path, {"shared": {"vllm_url": vllm_url}} if vllm_url else None)
    sections = {name: section for name, _, section in STAGES}
    for name in names:
        try:
            cfg.validate(sections[name])
        except ConfigError as e:
            raise ConfigError(f"stage {name} would refuse this config, so nothing was started: {e}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print run_all.sh's stage plan (tab-separated).")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan")
    pp.add_argument("--config", required=True)
    pp.add_argument("--vllm-url", nargs="+", default=[])
    pp.add_argument("--allow-human-answers", action="store_true")
    pp.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    sub.add_parser("data-dir").add_argument("--config", required=True)
    pc = sub.add_parser("check")
    pc.add_argument("--config", required=True)
    pc.add_argument("--vllm-url", nargs="*", default=[])
    pc.add_argument("--stages", nargs="*", default=[])
    args = p.parse_args(argv)
    try:
        if args.cmd == "data-dir":
            print(load_config(args.config).shared.data_dir)
            return 0
        if args.cmd == "check":
            check_stages(args.config, args.vllm_url, args.stages)
            return 0
        for row in plan(args.config, args.vllm_url, Path(args.repo), args.allow_human_answers):
            print("\t".join([row["name"], row["script"], row["hash"], row["marker"], row["started"], row["log"],
                             row["config"], " ".join(row["launcher"]) or "-", " ".join(row["resume"]) or "-",
                             " ".join(row["extra"])]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
