"""Stage 04's on-disk format, checkpoints/: the training checkpoints (step_N/), the training state, the skipped
samples list; their save/load/check. The folder's layout is ``records.DataDir``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .records import FORMAT_VERSION, FormatError, read_jsonl

# Training checkpoints (stage 04)
#
#   checkpoints/
#     step_{N}/            written under a temporary name, fsynced, renamed when complete (so a listed one is whole;
#                          --resume checks it and falls back on the newest whole one: check_train_checkpoint)
#       model.safetensors      the draft's own tensors (speculators names: layers.0.*, fc, norm, lm_head, d2t, t2d);
#                              the verifier's embedding / final norm / lm_head are reloaded from the verifier
#       optimizer.safetensors  AdamW state: "state.{param_index}.{step|exp_avg|exp_avg_sq}"
#       optimizer.json         param_groups (hyper-parameters, param indices)
#       scheduler.json         LR scheduler state_dict
#       training_state.json    TrainingState: step, epoch, batches done in that epoch, seed, tokens trained so far
#     metrics.jsonl        one line per logged train step ({"kind": "train", "step", ...}: means since the line before),
#                          per held-out evaluation ("eval": after a step, simulated_acceptance_length) and per epoch
#                          the packed rows trained ("rows": rows, samples, rows_per_rank; 04 checks each once)
#     run.json             {"settings": {...}}: draft architecture and data of the run, checked by --resume
#     curves.png           per-TTT-step loss and accuracy curves and the simulated acceptance length, redrawn at
#                          every evaluation
#     final/               the exported draft (flat LlamaForCausalLMEagle3, or speculators format)
#     export_step_{N}/     a step_N checkpoint exported by --export-from (its own provenance.json inside)
#     reports/             train.report_to's files: tensorboard/ (event files), wandb/ (runs), wandb_run_id

CKPT_MODEL_FILE = "model.safetensors"
CKPT_OPTIMIZER_FILE = "optimizer.safetensors"
CKPT_OPTIMIZER_GROUPS_FILE = "optimizer.json"
CKPT_SCHEDULER_FILE = "scheduler.json"
CKPT_STATE_FILE = "training_state.json"
CKPT_FILES = (CKPT_MODEL_FILE, CKPT_OPTIMIZER_FILE, CKPT_OPTIMIZER_GROUPS_FILE, CKPT_SCHEDULER_FILE, CKPT_STATE_FILE)


@dataclass
class TrainingState:
    """Where training stands at a checkpoint: resume continues with batch ``batches_done`` of ``epoch``."""

    step: int  # optimizer steps done in total
    epoch: int  # epoch in progress (== epochs once training finished)
    batches_done: int  # optimizer steps of ``epoch`` done (each world size x train.grad_accum packed rows)
    seed: int
    format_version: int = FORMAT_VERSION
    tokens: int = 0  # training tokens of every rank up to this step (metrics.jsonl's cumulative "tokens", which a
    # resume continues from); 0 in checkpoints written before it was kept

    def to_json(self) -> dict:
        return asdict(self)


def fsync_path(path: Path) -> None:
    """Flush a written file, or a folder's entries (the names a rename made), to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_train_checkpoint(folder: Path, model_state: dict, optimizer_state: dict, scheduler_state: dict,
                          state: TrainingState) -> None:
    """Write one training checkpoint folder atomically (temporary folder, then rename) and durably: every file and
    the temporary folder are fsynced before the rename and checkpoints/ after it, so that after a power cut a
    listed step_N is whole (a rename alone can reach the disk before the data it names)."""
    import shutil

    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items()}, str(tmp / CKPT_MODEL_FILE))
    opt_tensors = {f"state.{idx}.{name}": value.detach().cpu().contiguous()
                   for idx, entry in optimizer_state["state"].items() for name, value in entry.items()}
    save_file(opt_tensors, str(tmp / CKPT_OPTIMIZER_FILE))
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optimizer_state["param_groups"]]
    (tmp / CKPT_OPTIMIZER_GROUPS_FILE).write_text(json.dumps(groups))
    (tmp / CKPT_SCHEDULER_FILE).write_text(json.dumps(scheduler_state))
    (tmp / CKPT_STATE_FILE).write_text(json.dumps(state.to_json()))
    for name in CKPT_FILES:
        fsync_path(tmp / name)
    fsync_path(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    fsync_path(folder.parent)


def check_train_checkpoint(folder: Path) -> str | None:
    """Why ``folder`` is not a whole checkpoint (None: it is), without reading its tensors: every file there, each
    safetensors file as long as its header says, each JSON file parsing (a power cut before the data reached the
    disk leaves files empty or short)."""
    folder = Path(folder)
    for name in CKPT_FILES:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        try:
            if name.endswith(".safetensors"):
                with open(path, "rb") as f:
                    head = f.read(8)
                    if len(head) < 8:
                        return f"{name} holds {size} bytes"
                    header_len = int.from_bytes(head, "little")
                    header = json.loads(f.read(header_len))
                ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
                if size != 8 + header_len + max(ends, default=0):
                    return f"{name} holds {size} bytes, its header names {8 + header_len + max(ends, default=0)}"
            else:
                json.loads(path.read_text())
        except (ValueError, KeyError, TypeError, OSError) as e:
            return f"{name} does not parse ({type(e).__name__}: {str(e)[:100]})"
    return None


def load_train_checkpoint(folder: Path) -> tuple[dict, dict, dict, TrainingState]:
    """(model_state, optimizer_state, scheduler_state, TrainingState) of one checkpoint folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in CKPT_FILES:
        if not (folder / name).is_file():
            raise FormatError(f"{folder}: checkpoint lacks {name}")
    model_state = load_file(str(folder / CKPT_MODEL_FILE))
    state: dict[int, dict] = {}
    for key, value in load_file(str(folder / CKPT_OPTIMIZER_FILE)).items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    groups = json.loads((folder / CKPT_OPTIMIZER_GROUPS_FILE).read_text())
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    scheduler_state = json.loads((folder / CKPT_SCHEDULER_FILE).read_text())
    training_state = TrainingState(**json.loads((folder / CKPT_STATE_FILE).read_text()))
    return model_state, {"state": state, "param_groups": groups}, scheduler_state, training_state


@dataclass
class SkippedSample:
    """A sample stage 04 read and trained (or evaluated) without: its states file failed a read check (states for
    fewer or more tokens than its token ids, token ids that are not the row's). One line of
    ``DataDir.train_skipped`` each, written by rank 0 for every rank; counted per epoch against --max-error-share."""

    epoch: int  # 0-based
    step: int  # the optimizer step (1-based) whose rows held it; held out: the step the evaluation followed
    file: str  # the states file read
    index: int  # its row in the rows dataset the file belongs to (hs_{index})
    reason: str
    held_out: bool = False  # read for the evaluation after the epoch, not trained
    rank: int = 0  # the rank that read it

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str = "") -> "SkippedSample":
        try:
            return cls(**d)
        except TypeError as e:
            raise FormatError(f"{where}: not a skipped-sample record ({e})") from None


def load_skipped_samples(path: Path) -> list[SkippedSample]:
    """Every SkippedSample of ``path`` (none when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [SkippedSample.from_json(d, f"{path}:{i}") for i, d in enumerate(read_jsonl(path), 1)]


def list_train_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Complete step_N checkpoint folders, ascending by N (temporary folders are not listed)."""
    out = []
    for p in Path(checkpoints_dir).glob("step_*"):
        suffix = p.name.removeprefix("step_")
        if p.is_dir() and suffix.isdigit() and (p / CKPT_STATE_FILE).is_file():
            out.append((int(suffix), p))
    return sorted(out)
