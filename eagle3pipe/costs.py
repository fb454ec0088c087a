"""What a run will cost before its expensive part: ``run_all.sh --plan`` (``python -m eagle3pipe.costs``).

Per stage: rows, tokens, disk (hidden states, the online spool, checkpoints) and hours, from the config alone plus the
rates of its ``plan`` section (defaults: Kimi-K2.5 on 8 x H200, measured or projected in BENCHMARKS.md; each field
says which). Once stage 01 has run, the number of questions is counted in ``prepared/questions.jsonl`` instead of
taken from ``prepare.max_samples``. ``run_all.sh`` runs ``--check-disk`` before stage 01b (after 01, which is cheap):
the whole run's disk against the free space of the data dir's disk, so a run that cannot fit stops before 01b spends
its hours, not in 02. ``extract.force_disk`` lets it start anyway.

The figures are simple products, shown with their inputs, so that a reader can redo them by hand:

- 01b: requests = min(generate.max_samples, questions); generated tokens = requests x min(plan.completion_tokens,
  generate.max_completion_tokens); hours = generated / (plan.generate_tokens_per_s x servers) (+ one server start
  when 01b starts its own server).
- rows after 01b = requests (without 01b: the questions, answered by the datasets); tokens per row =
  min(plan.prompt_tokens + plan.completion_tokens, shared.max_seq_len); the bound uses shared.max_seq_len.
- 02: states = ``records.hs_bytes_estimate`` of those tokens (aux layers + the final state, storage dtype);
  hours = tokens / (plan.extract_tokens_per_s x servers) (+ one server start when 02 starts its own).
- 04: packed rows an epoch = ceil(tokens x (1 - train.eval_fraction) / (train.total_seq_len x plan.packing_fill)),
  the training tokens cut to train.max_samples x tokens per row when it keeps fewer rows than the training split's;
  steps = epochs x ceil(rows / (processes x grad_accum)) (cut by max_steps); hours = epochs x training tokens /
  (plan.train_tokens_per_s x processes x plan.train_scaling when processes > 1); checkpoints written = one every
  checkpoint_every steps and one at the end; on disk at once = at most keep_checkpoints + 1 (a save comes before the
  prune; + the best step with train.export best), each plan.checkpoint_gb or else the size of the draft 04 builds
  (``draft_size``: its family's model on the meta device), + the export. Online: disk = train.spool_gb +
  train.cache_gb, hours = the larger of training and one extraction an epoch.

Each rate is printed with where its default comes from (``RATE_BASIS``: measured, projected or assumed; the training
rate of a draft family it was not measured for says so).
- 05: per server (the draft, the verifier alone, each baseline draft) and concurrency level c: sets x num_prompts x
  max_completion_tokens / (c x plan.evaluate_tokens_per_s), an upper bound (every answer at its cap).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .config import ConfigError, PipelineConfig, PlanConfig, load_config
from .records import DataDir, hs_bytes_estimate

GB = 1e9


@dataclass
class StageCost:
    """One stage's row of the plan."""

    name: str
    rows: int | None  # samples (01b: requests; 04: packed rows of all epochs; 05: requests of all passes)
    tokens: int | None  # tokens the stage computes (01b: generated; 02: extracted; 04: trained, all epochs)
    disk_bytes: int  # what the stage leaves on disk at its peak
    hours: float | None
    how: str  # the inputs, so that the figures can be checked by hand


@dataclass
class RunCosts:
    questions: int
    questions_from: str  # "prepared/questions.jsonl" or "prepare.max_samples"
    rows: int  # training rows (after 01b, or the prepared rows)
    tokens_per_row: int
    bound_tokens_per_row: int  # shared.max_seq_len
    train_processes: int
    train_processes_from: str  # where that number comes from (train_processes)
    stages: list[StageCost] = field(default_factory=list)
    not_counted: list[str] = field(default_factory=list)  # disk the plan could not size here, and why

    @property
    def disk_bytes(self) -> int:
        return sum(s.disk_bytes for s in self.stages)

    @property
    def hours(self) -> float:
        return sum(s.hours or 0.0 for s in self.stages)

    def bound_disk_bytes(self, cfg: PipelineConfig) -> int:
        """The disk with every row at shared.max_seq_len (states only change)."""
        extra = 0
        if cfg.train.data_source == "offline":
            extra = _states_bytes(cfg, self.rows, self.bound_tokens_per_row) - \
                _states_bytes(cfg, self.rows, self.tokens_per_row)
        return self.disk_bytes + extra


# Where each default of the plan section comes from (BENCHMARKS.md "Sizing a run" and config.py's PlanConfig say
# how): measured on an H200 here, or projected from others' figures, or assumed. A value the config sets is its own.
RATE_BASIS = {"generate_tokens_per_s": "projected", "extract_tokens_per_s": "projected",
              "train_tokens_per_s": "measured for EAGLE-3 on one H200", "train_scaling": "projected",
              "packing_fill": "measured", "evaluate_tokens_per_s": "projected", "server_start_s": "projected",
              "prompt_tokens": "assumed", "completion_tokens": "assumed"}


def rate_basis(cfg: PipelineConfig, key: str) -> str:
    """Whether plan.``key`` was measured, projected or assumed (or set in this config)."""
    import dataclasses

    default = next(f.default for f in dataclasses.fields(PlanConfig) if f.name == key)
    if getattr(cfg.plan, key) != default:
        return "this config's"
    if key == "train_tokens_per_s" and cfg.train.draft != "eagle3":
        return f"EAGLE-3's, measured on one H200; NOT MEASURED for a {cfg.train.draft} draft"
    return RATE_BASIS[key]


def check_plan_section(cfg: PipelineConfig) -> None:
    p = cfg.plan
    for key in ("generate_tokens_per_s", "extract_tokens_per_s", "train_tokens_per_s", "evaluate_tokens_per_s"):
        if not getattr(p, key) > 0:
            raise ConfigError(f"plan.{key} must be > 0 tokens/s, got {getattr(p, key)}")
    for key in ("train_scaling", "packing_fill"):
        if not 0 < getattr(p, key) <= 1:
            raise ConfigError(f"plan.{key} must be in (0, 1], got {getattr(p, key)}")
    for key in ("prompt_tokens", "completion_tokens", "checkpoint_gb", "server_start_s"):
        if getattr(p, key) < 0:
            raise ConfigError(f"plan.{key} must be >= 0, got {getattr(p, key)}")


def visible_gpu_count() -> int:
    """GPUs a process started here would see: CUDA_VISIBLE_DEVICES when set, else nvidia-smi's list (no torch import:
    run_all calls this before every run)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def server_tp_sizes(cfg: PipelineConfig) -> dict[str, int]:
    """The tensor-parallel size each server started here asks for."""
    out = {}
    for key, args in (("generate.server_args", cfg.generate.server_args), ("extract.server_args",
                                                                            cfg.extract.server_args)):
        words = list(args)  # config.py keeps server_args as a list of vLLM's words
        for i, w in enumerate(words):
            if w in ("--tensor-parallel-size", "-tp") and i + 1 < len(words):
                out[key] = int(words[i + 1])
            elif w.startswith("--tensor-parallel-size="):
                out[key] = int(w.split("=", 1)[1])
    if cfg.evaluate.tensor_parallel_size:
        out["evaluate.tensor_parallel_size"] = cfg.evaluate.tensor_parallel_size
    if cfg.train.nproc_per_node > 1:
        out["train.nproc_per_node"] = cfg.train.nproc_per_node
    return out


def train_processes(cfg: PipelineConfig) -> tuple[int, str]:
    """(the processes 04 will train on, where that number comes from): train.nproc_per_node, else every visible GPU
    (run_all.train_processes' rule, without importing torch). Where no GPU is visible (a login node) for a config
    that trains on GPUs, the largest tensor-parallel size its servers ask for: the GPUs of the node the config was
    written for (8 for the K2.5 configs), said in the plan."""
    t = cfg.train
    if t.nproc_per_node:
        return t.nproc_per_node, "train.nproc_per_node"
    if t.device == "cpu":
        return 1, "train.device cpu"
    visible = visible_gpu_count()
    if visible:
        return visible, "every GPU visible here"
    sizes = {k: v for k, v in server_tp_sizes(cfg).items() if v > 1}
    if sizes:
        key = max(sizes, key=sizes.get)
        return sizes[key], (f"NO GPU VISIBLE HERE: planned on the {sizes[key]} GPUs of the node {key} asks for; "
                            "set train.nproc_per_node to plan another count")
    return 1, "no GPU visible here and none asked for: one process"


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


@dataclass
class DraftSize:
    """What a new draft of the run's family stores: the tensors of 04's checkpoints (``train.draft_state``: the
    verifier's embedding, norm and lm_head are not saved) counted on the model 04 builds."""

    family: str  # train.draft
    params: int  # floating-point parameters saved (the draft's own lm_head included)
    trainable: int  # those AdamW updates (lm_head only with train.train_lm_head)
    buffer_bytes: int  # the other tensors saved (d2t int64, t2d bool)

    @property
    def checkpoint_bytes(self) -> int:
        """step_N: fp32 weights, AdamW's two fp32 moments per trainable parameter, the buffers."""
        return 4 * self.params + 8 * self.trainable + self.buffer_bytes

    @property
    def export_bytes(self) -> int:
        """final/: bf16 weights and the buffers."""
        return 2 * self.params + self.buffer_bytes


@contextlib.contextmanager
def _without_verifier_weights():
    """speculators' ``from_training_args`` reads the verifier's embedding and lm_head from its weight files; sizing
    needs the shapes alone (the verifier's config.json), so that read is left out while the model is built."""
    from speculators.model import SpeculatorModel

    classes, todo = [], [SpeculatorModel]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if "load_verifier_weights" in vars(cls):
            classes.append((cls, vars(cls)["load_verifier_weights"]))
    try:
        for cls, _ in classes:
            cls.load_verifier_weights = lambda self: None
        yield
    finally:
        for cls, method in classes:
            cls.load_verifier_weights = method


def draft_size(cfg: PipelineConfig) -> DraftSize:
    """The size of the draft 04 builds for this config: its family's ``new_model`` (train_drafts.draft_family: one
    per train.draft, the same call 04 makes for a new draft), built on the meta device, where it takes no memory and
    reads only the verifier's config.json. A --finetune-from draft is sized at the train.* dims (it keeps its own).
    Raises ConfigError when the verifier's config.json cannot be read here."""
    import torch

    from .cli import StageError
    from .train import draft_state, set_lm_head_training
    from .train_drafts import draft_family

    s = cfg.shared
    family = draft_family(cfg, torch.device("meta"))
    # a valid map of the right shapes (the first draft_vocab_size ids): speculators checks it as it loads it
    d2t = torch.zeros(s.draft_vocab_size, dtype=torch.int64)
    t2d = torch.arange(s.vocab_size) < s.draft_vocab_size
    try:
        with torch.device("meta"), _without_verifier_weights(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "copying from a non-meta parameter ... is a no-op": as intended
            model, _ = family.new_model(d2t, t2d, "sdpa")
    except (OSError, StageError) as e:  # StageError: verifier.VerifierLoadError (no config.json)
        raise ConfigError(f"the {cfg.train.draft} draft cannot be sized without the verifier's config.json "
                          f"({s.verifier}/config.json: {str(e).strip().splitlines()[0][:300]}): copy it there, or "
                          "set plan.checkpoint_gb") from None
    except ValueError as e:  # the model 04 would build refuses this config (e.g. aux layers the verifier lacks)
        raise ConfigError(f"the {cfg.train.draft} draft 04 would build from this config is refused ("
                          f"{str(e).strip().splitlines()[0][:300]}): fix the config, or set plan.checkpoint_gb") \
            from None
    logging.getLogger("eagle3pipe.train").disabled, was = True, logging.getLogger("eagle3pipe.train").disabled
    try:
        set_lm_head_training(model, cfg)  # the trainer's own rule for which tensors AdamW updates
    finally:
        logging.getLogger("eagle3pipe.train").disabled = was
    saved = draft_state(model)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    params = {k: v for k, v in saved.items() if v.is_floating_point()}
    return DraftSize(family=family.name, params=sum(v.numel() for v in params.values()),
                     trainable=sum(p.numel() for n, p in model.named_parameters()
                                   if id(p) in trainable and n in params),
                     buffer_bytes=sum(v.numel() * v.element_size() for k, v in saved.items() if k not in params))


def _states_bytes(cfg: PipelineConfig, rows: int, tokens_per_row: int) -> int:
    num_states = len(cfg.shared.aux_layer_ids) + 1  # the aux layers' states, then the final one
    return hs_bytes_estimate(rows * tokens_per_row, rows, num_states, cfg.shared.hidden_size,
                             cfg.extract.storage_dtype)


def _servers_started(urls: list[str]) -> int:
    return 0 if urls else 1


def estimate(cfg: PipelineConfig) -> RunCosts:
    """The plan of ``cfg`` (see the module docstring for each figure)."""
    check_plan_section(cfg)
    s, g, ex, t, ev, p = cfg.shared, cfg.generate, cfg.extract, cfg.train, cfg.evaluate, cfg.plan
    dd = DataDir(cfg.data_dir)
    if dd.questions.is_file():
        questions, questions_from = count_lines(dd.questions), "prepared/questions.jsonl"
    elif cfg.prepare.max_samples:
        questions, questions_from = cfg.prepare.max_samples, "prepare.max_samples"
    else:
        raise ConfigError("prepare.max_samples is 0 (no cap) and prepared/questions.jsonl does not exist yet: the "
                          "plan needs a number of questions; run 01_prepare_data.py first, or set --max-samples")
    has_01b = bool(s.vllm_url or g.server_args)  # run_all's rule: a URL, or 01b starts its own server
    requests = questions if not g.max_samples else min(g.max_samples, questions)
    rows = requests if has_01b else questions
    tokens_per_row = min(p.prompt_tokens + p.completion_tokens, s.max_seq_len)
    tokens = rows * tokens_per_row
    processes, processes_from = train_processes(cfg)
    out = RunCosts(questions=questions, questions_from=questions_from, rows=rows, tokens_per_row=tokens_per_row,
                   bound_tokens_per_row=s.max_seq_len, train_processes=processes, train_processes_from=processes_from)

    out.stages.append(StageCost("01_prepare", questions, None, 0, None, f"{questions} questions ({questions_from})"))
    if has_01b:
        completion = min(p.completion_tokens, g.max_completion_tokens)
        servers = max(1, len(s.vllm_url))
        starts = _servers_started(s.vllm_url)
        hours = requests * completion / (p.generate_tokens_per_s * servers) / 3600 + starts * p.server_start_s / 3600
        out.stages.append(StageCost(
            "01b_generate", requests, requests * completion, 0, hours,
            f"{requests} requests x {completion} generated tokens / ({p.generate_tokens_per_s:g} tok/s "
            f"({rate_basis(cfg, 'generate_tokens_per_s')}) x {servers} server(s))"
            + (f" + {starts} server start of {p.server_start_s:g} s" if starts else "")))

    if t.data_source == "offline":
        servers = max(1, len(ex.extract_url)) if ex.backend == "vllm" else 1
        starts = _servers_started(ex.extract_url) if ex.backend == "vllm" else 0
        states = _states_bytes(cfg, rows, tokens_per_row)
        hours = tokens / (p.extract_tokens_per_s * servers) / 3600 + starts * p.server_start_s / 3600
        out.stages.append(StageCost(
            "02_extract", rows, tokens, states, hours,
            f"{rows} rows x {tokens_per_row} tokens; states {ex.storage_dtype} ({len(s.aux_layer_ids) + 1} x "
            f"{s.hidden_size}); {p.extract_tokens_per_s:g} tok/s ({rate_basis(cfg, 'extract_tokens_per_s')}) x "
            f"{servers} server(s)"
            + (f" + {starts} server start" if starts else "")))
    else:
        out.stages.append(StageCost("02_extract", 0, 0, 0, 0.0,
                                    "train.data_source online: 04 extracts the states as it trains"))
    out.stages.append(StageCost("03_vocab", rows, None, 0, None, "counts the rows' supervised tokens (minutes)"))

    world = out.train_processes
    train_tokens = math.floor(tokens * (1 - t.eval_fraction))
    held_tokens = tokens - train_tokens  # online: extracted at each evaluation besides the training rows
    train_rows = int(rows * (1 - t.eval_fraction))  # train_batches.split_files' training split
    cut = bool(t.max_samples) and t.max_samples < train_rows  # train.max_samples trains fewer
    if cut:
        train_tokens = t.max_samples * tokens_per_row
    packed_per_epoch = math.ceil(train_tokens / (t.total_seq_len * p.packing_fill))
    steps_per_epoch = math.ceil(packed_per_epoch / (world * t.grad_accum))
    steps = steps_per_epoch * t.epochs if not t.max_steps else min(t.max_steps, steps_per_epoch * t.epochs)
    done_share = steps / (steps_per_epoch * t.epochs) if steps_per_epoch else 0.0
    rate = p.train_tokens_per_s * world * (p.train_scaling if world > 1 else 1.0)
    hours = t.epochs * train_tokens * done_share / rate / 3600
    # a checkpoint every checkpoint_every steps and one at the end (TrainingLoop.run); each save is written before
    # the oldest is pruned to keep_checkpoints, and train.export best keeps the best evaluation's step besides
    written = steps // t.checkpoint_every + (1 if steps % t.checkpoint_every else 0)
    at_once = min(written, t.keep_checkpoints + 1 + (t.export == "best")) if t.keep_checkpoints else written
    how = ((f"train.max_samples {t.max_samples} of the {train_rows} training rows; " if cut else "")
           + f"{t.epochs} epochs x {train_tokens} tokens / ({t.total_seq_len}-token rows x fill {p.packing_fill:g}) = "
           f"{packed_per_epoch} rows an epoch, {steps} steps on {world} process(es) ({out.train_processes_from}) x "
           f"grad_accum {t.grad_accum}; {p.train_tokens_per_s:g} tok/s a process "
           f"({rate_basis(cfg, 'train_tokens_per_s')})"
           + (f" x {p.train_scaling:g} ({rate_basis(cfg, 'train_scaling')})" if world > 1 else ""))
    if p.checkpoint_gb:
        one, export = round(p.checkpoint_gb * GB), 0
        how += (f"; {written} checkpoints written, {at_once} on disk at once, {one / GB:.2f} GB each "
                "(plan.checkpoint_gb)")
    else:
        try:
            size = draft_size(cfg)
        except ConfigError as e:
            size = None
            out.not_counted.append(f"04's checkpoints ({written} written, {at_once} on disk at once): {e}")
            how += f"; {written} checkpoints written, {at_once} on disk at once: NOT COUNTED ({e})"
    if not p.checkpoint_gb and size is None:
        one = export = 0
    elif not p.checkpoint_gb:
        one, export = size.checkpoint_bytes, size.export_bytes
        how += (f"; {written} checkpoints written (the last at the end), {at_once} on disk at once, {one / GB:.2f} GB "
                f"each ({size.family} draft: {size.params / 1e6:,.0f} M parameters, {size.trainable / 1e6:,.0f} M "
                f"trained" + ("; sized at train.* dims, --finetune-from keeps its own" if t.finetune_from else "")
                + f") + export {export / GB:.2f} GB")
    ckpt_bytes = at_once * one + export
    disk = ckpt_bytes
    if t.data_source == "online":
        servers = max(1, len(ex.extract_url))
        extract_hours = t.epochs * (train_tokens + held_tokens) * done_share / (p.extract_tokens_per_s * servers) / 3600
        hours = max(hours, extract_hours) + _servers_started(ex.extract_url) * p.server_start_s / 3600
        disk += round((t.spool_gb + t.cache_gb) * GB)
        how += (f"; online: each epoch extracted at {p.extract_tokens_per_s:g} tok/s x {servers} server(s), spool "
                f"{t.spool_gb:g} GB + cache {t.cache_gb:g} GB")
    out.stages.append(StageCost("04_train", packed_per_epoch * t.epochs, round(t.epochs * train_tokens * done_share),
                                disk, hours, how))

    sets = len(ev.benchmarks) + (1 if ev.prompts else 0)
    servers = (0 if ev.eval_url else 1) + (1 if ev.baseline and not ev.baseline_url else 0) + len(ev.baseline_draft)
    passes = 1 + (1 if ev.baseline else 0) + len(ev.baseline_draft)  # columns measured, each at every level
    if not sets:
        out.stages.append(StageCost("05_evaluate", None, None, 0, None, "no evaluate.prompts nor evaluate.benchmarks: "
                                    "not costed"))
    elif ev.num_prompts:
        requests = passes * len(ev.concurrency) * sets * ev.num_prompts
        per_pass = sets * ev.num_prompts * ev.max_completion_tokens
        hours = passes * sum(per_pass / (c * p.evaluate_tokens_per_s) for c in ev.concurrency) / 3600 \
            + servers * p.server_start_s / 3600
        out.stages.append(StageCost(
            "05_evaluate", requests, passes * len(ev.concurrency) * per_pass, 0, hours,
            f"{passes} column(s) x levels {ev.concurrency} x {sets} set(s) x {ev.num_prompts} prompts x at most "
            f"{ev.max_completion_tokens} tokens at {p.evaluate_tokens_per_s:g} tok/s a request "
            f"({rate_basis(cfg, 'evaluate_tokens_per_s')}); {servers} server start(s)"))
    else:
        out.stages.append(StageCost("05_evaluate", None, None, 0, None, "evaluate.num_prompts 0 (every prompt of "
                                    "each set): not costed"))
    return out


def free_bytes(path: Path) -> tuple[Path, int]:
    """(the nearest existing folder at or above ``path``, the free bytes of its filesystem)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def disk_problem(cfg: PipelineConfig, costs: RunCosts) -> str | None:
    """Why the run will not fit on the data dir's disk (None: it fits). Finished stage outputs already on disk are not
    counted again (a finished hidden_states/ holds its states)."""
    if costs.not_counted:
        return (f"the plan cannot size {'; '.join(costs.not_counted)}: the disk check needs it (or set "
                "extract.force_disk to start anyway)")
    need = costs.disk_bytes
    dd = DataDir(cfg.data_dir)
    if dd.hs_manifest.is_file():
        need -= next(s.disk_bytes for s in costs.stages if s.name == "02_extract")
    where, free = free_bytes(cfg.data_dir)
    if need <= free:
        return None
    parts = ", ".join(f"{s.name} {s.disk_bytes / GB:.1f} GB" for s in costs.stages if s.disk_bytes)
    return (f"the run needs {need / GB:.1f} GB on {where} ({parts}) but {free / GB:.1f} GB are free: free space, "
            "store states as fp8 (--storage-dtype fp8 halves them), train online (train.data_source online keeps "
            "only train.spool_gb), lower prepare.max_samples / generate.max_samples, or set extract.force_disk to "
            "start anyway")


def _fmt(x: float | int | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_costs(cfg: PipelineConfig, costs: RunCosts) -> str:
    """The plan as a table, then each stage's inputs and the disk check."""
    lines = [f"plan for {cfg.source} (data dir {cfg.data_dir}): {costs.questions} questions ({costs.questions_from}), "
             f"{costs.rows} training rows of {costs.tokens_per_row} tokens (plan.prompt_tokens + "
             f"plan.completion_tokens, at most shared.max_seq_len {costs.bound_tokens_per_row})",
             f"{'stage':<13} {'rows':>10} {'tokens':>15} {'disk GB':>10} {'hours':>8}"]
    for st in costs.stages:
        lines.append(f"{st.name:<13} {_fmt(st.rows, ','):>10} {_fmt(st.tokens, ','):>15} "
                     f"{st.disk_bytes / GB:>10.1f} {_fmt(st.hours, '.2f'):>8}")
    lines.append(f"{'total':<13} {'':>10} {'':>15} {costs.disk_bytes / GB:>10.1f} {costs.hours:>8.2f}")
    lines += [f"  {st.name:<13} {st.how}" for st in costs.stages]
    where, free = free_bytes(cfg.data_dir)
    lines.append(f"disk: {costs.disk_bytes / GB:.1f} GB needed ({costs.bound_disk_bytes(cfg) / GB:.1f} GB if every "
                 f"row reached max_seq_len), {free / GB:.1f} GB free on {where}")
    lines += [f"DISK NOT COUNTED: {what}" for what in costs.not_counted]
    lines.append(f"04 on {costs.train_processes} process(es): {costs.train_processes_from}")
    lines.append("rates (the plan section: docs/sizing.md, docs/reference.md#plan; measure yours with --status): "
                 + ", ".join(f"{key} {getattr(cfg.plan, key):g} ({rate_basis(cfg, key)})" for key in RATE_BASIS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print what each stage of a run will cost (rows, tokens, disk, hours) "
                                             "from the config and its plan section's rates.")
    ap.add_argument("--config", required=True, help="the run's YAML config")
    ap.add_argument("--vllm-url", nargs="+", action="extend", default=[], help="server URL(s) for 01b, as "
                    "run_all.sh --vllm-url (01b runs only with one, or with generate.server_args)")
    ap.add_argument("--check-disk", action="store_true",
                    help="exit 2 when the whole run will not fit on the data dir's disk (extract.force_disk: warn)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, {"shared": {"vllm_url": args.vllm_url}} if args.vllm_url else None)
        costs = estimate(cfg)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_costs(cfg, costs))
    if args.check_disk:
        problem = disk_problem(cfg, costs)
        if problem and not cfg.extract.force_disk:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        if problem:
            print(f"warning: {problem} (extract.force_disk is set: starting anyway)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
