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
- 04: packed rows an epoch = ceil(tokens x (1 - train.eval_fraction) / (train.total_seq_len x plan.packing_fill));
  steps = epochs x ceil(rows / (processes x grad_accum)) (cut by max_steps); hours = epochs x training tokens /
  (plan.train_tokens_per_s x processes x plan.train_scaling when processes > 1); checkpoints on disk at once =
  min(keep_checkpoints, checkpoints written) + 1 (a save comes before the prune) x plan.checkpoint_gb + export_gb.
  Online: disk = train.spool_gb + train.cache_gb, hours = the larger of training and one extraction an epoch.
- 05: per server (the draft, the verifier alone, each baseline draft) and concurrency level c: sets x num_prompts x
  max_completion_tokens / (c x plan.evaluate_tokens_per_s), an upper bound (every answer at its cap).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .config import ConfigError, PipelineConfig, load_config
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
    stages: list[StageCost] = field(default_factory=list)

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


def train_processes(cfg: PipelineConfig) -> int:
    """The processes run_all starts for 04 (run_all.train_processes' rule, without importing torch)."""
    n = cfg.train.nproc_per_node
    if n == 0:
        n = 1 if cfg.train.device == "cpu" else (visible_gpu_count() or 1)
    return n


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


@dataclass
class DraftSize:
    """Parameters of a new draft (``draft.flat_tensor_shapes``' tensors) and what it takes on disk."""

    params: int  # every float tensor of the draft (its own lm_head included; the verifier's embedding is not saved)
    trainable: int  # those AdamW updates (lm_head only with train.train_lm_head)
    draft_vocab: int
    vocab: int

    @property
    def checkpoint_bytes(self) -> int:
        """step_N: fp32 weights, AdamW's two fp32 moments per trainable parameter, d2t int64 and t2d bool."""
        return 4 * self.params + 8 * self.trainable + 8 * self.draft_vocab + self.vocab

    @property
    def export_bytes(self) -> int:
        """final/: bf16 weights, d2t and t2d."""
        return 2 * self.params + 8 * self.draft_vocab + self.vocab


def draft_size(cfg: PipelineConfig) -> DraftSize | None:
    """The size of the draft 04 builds (None when it depends on a verifier config.json that cannot be read here: the
    draft's attention or MLP width left at 0 = the verifier's). A warm start (train.finetune_from) keeps its own
    dims."""
    import json

    from .draft import draft_attention_geometry

    s, t = cfg.shared, cfg.train
    inter = t.draft_intermediate_size
    text = {"num_attention_heads": t.draft_num_heads or 1, "num_key_value_heads": t.draft_num_kv_heads or 1,
            "head_dim": t.draft_head_dim or 1}  # stands for the verifier when every dimension is given
    if not (t.draft_num_heads and t.draft_num_kv_heads and t.draft_head_dim and inter):
        try:
            config = json.loads((Path(s.verifier) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        text = config.get("text_config") or config  # Kimi-K2.5 nests its language model's config
        inter = inter or int(text["intermediate_size"])
    heads, kv_heads, head_dim = draft_attention_geometry(text, t.draft_num_heads, t.draft_num_kv_heads,
                                                         t.draft_head_dim)
    h, n = s.hidden_size, s.draft_vocab_size
    # fc [H, 3H]; q [heads x head_dim, 2H]; k, v [kv heads x head_dim, 2H]; o [H, heads x head_dim]; gate, up, down;
    # 4 norms
    layer = (len(s.aux_layer_ids) * h * h + (heads + 2 * kv_heads) * head_dim * 2 * h + h * heads * head_dim
             + 3 * inter * h + 4 * h)
    lm_head = n * h
    return DraftSize(params=layer + lm_head, trainable=layer + (lm_head if t.train_lm_head else 0), draft_vocab=n,
                     vocab=s.vocab_size)


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
    out = RunCosts(questions=questions, questions_from=questions_from, rows=rows, tokens_per_row=tokens_per_row,
                   bound_tokens_per_row=s.max_seq_len, train_processes=train_processes(cfg))

    out.stages.append(StageCost("01_prepare", questions, None, 0, None, f"{questions} questions ({questions_from})"))
    if has_01b:
        completion = min(p.completion_tokens, g.max_completion_tokens)
        servers = max(1, len(s.vllm_url))
        starts = _servers_started(s.vllm_url)
        hours = requests * completion / (p.generate_tokens_per_s * servers) / 3600 + starts * p.server_start_s / 3600
        out.stages.append(StageCost(
            "01b_generate", requests, requests * completion, 0, hours,
            f"{requests} requests x {completion} generated tokens / ({p.generate_tokens_per_s:g} tok/s x {servers} "
            f"server(s))" + (f" + {starts} server start of {p.server_start_s:g} s" if starts else "")))

    if t.data_source == "offline":
        servers = max(1, len(ex.extract_url)) if ex.backend == "vllm" else 1
        starts = _servers_started(ex.extract_url) if ex.backend == "vllm" else 0
        states = _states_bytes(cfg, rows, tokens_per_row)
        hours = tokens / (p.extract_tokens_per_s * servers) / 3600 + starts * p.server_start_s / 3600
        out.stages.append(StageCost(
            "02_extract", rows, tokens, states, hours,
            f"{rows} rows x {tokens_per_row} tokens; states {ex.storage_dtype} ({len(s.aux_layer_ids) + 1} x "
            f"{s.hidden_size}); {p.extract_tokens_per_s:g} tok/s x {servers} server(s)"
            + (f" + {starts} server start" if starts else "")))
    else:
        out.stages.append(StageCost("02_extract", 0, 0, 0, 0.0,
                                    "train.data_source online: 04 extracts the states as it trains"))
    out.stages.append(StageCost("03_vocab", rows, None, 0, None, "counts the rows' supervised tokens (minutes)"))

    world = out.train_processes
    train_tokens = math.floor(tokens * (1 - t.eval_fraction))
    packed_per_epoch = math.ceil(train_tokens / (t.total_seq_len * p.packing_fill))
    steps_per_epoch = math.ceil(packed_per_epoch / (world * t.grad_accum))
    steps = steps_per_epoch * t.epochs if not t.max_steps else min(t.max_steps, steps_per_epoch * t.epochs)
    done_share = steps / (steps_per_epoch * t.epochs) if steps_per_epoch else 0.0
    rate = p.train_tokens_per_s * world * (p.train_scaling if world > 1 else 1.0)
    hours = t.epochs * train_tokens * done_share / rate / 3600
    written = steps // t.checkpoint_every
    kept = min(t.keep_checkpoints, written) if t.keep_checkpoints else written
    at_once = kept + 1 if written > kept else kept  # a new checkpoint is saved before the oldest is pruned
    size = draft_size(cfg)
    how = (f"{t.epochs} epochs x {train_tokens} tokens / ({t.total_seq_len}-token rows x fill {p.packing_fill:g}) = "
           f"{packed_per_epoch} rows an epoch, {steps} steps on {world} process(es) x grad_accum {t.grad_accum}; "
           f"{p.train_tokens_per_s:g} tok/s a process" + (f" x {p.train_scaling:g}" if world > 1 else ""))
    if p.checkpoint_gb or size is not None:
        one = round(p.checkpoint_gb * GB) if p.checkpoint_gb else size.checkpoint_bytes
        export = size.export_bytes if size is not None else 0
        ckpt_bytes = at_once * one + export
        how += (f"; {written} checkpoints written, {at_once} on disk at once, {one / GB:.2f} GB each"
                + (f" (draft: {size.params / 1e6:.1f} M parameters, {size.trainable / 1e6:.1f} M trained)"
                   if size is not None and not p.checkpoint_gb else " (plan.checkpoint_gb)")
                + (f" + export {export / GB:.2f} GB" if export else ""))
    else:
        ckpt_bytes = 0
        how += (f"; checkpoints NOT COUNTED: the draft's size needs {s.verifier}/config.json (draft heads / MLP width "
                "0 = the verifier's): set plan.checkpoint_gb")
    disk = ckpt_bytes
    if t.data_source == "online":
        servers = max(1, len(ex.extract_url))
        extract_hours = t.epochs * tokens * done_share / (p.extract_tokens_per_s * servers) / 3600
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
            f"{ev.max_completion_tokens} tokens at {p.evaluate_tokens_per_s:g} tok/s a request; {servers} server "
            "start(s)"))
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
    lines.append("rates: the plan section of the config (docs/sizing.md, docs/reference.md#plan); "
                 "measure yours with --status")
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
