"""Trained toy reasoning verifier: a small Llama taught to answer the generated task mix like a reasoning model.

The untrained toy verifier (``toy.py``) emits noise, so a draft trained against it measures nothing. This module
trains one on ``toy_tasks``' seeded task mix rendered with the toy's K2.5-shaped chat template: question, then
``<think>`` step-by-step working ``</think>``, then a short answer. Served by vLLM CPU, it then behaves like a
reasoning model at work (low-entropy working, right answers), which is what the stages and the quality
experiment need. Sizes:

- ``ci``: hidden 128, 8 layers; trains on 2 CPU cores in a few minutes; shipped in ``data/ci/verifier`` (the demo
  and the tests use it; a test rebuilds it with this command and compares the two);
- ``bench``: hidden 256, 8 layers; trained once on a GPU (the H200), shipped in ``data/bench/verifier``;
- ``gpu-dense``: a Llama of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192: 0.97 B
  parameters in its layers) with 163,840 vocabulary rows like K2.5's, so that the verifier's output layer (and a
  draft's, at 32 k rows) costs what it does in practice; trained on one H100/H200 in minutes, never shipped (3.3 GB);
- ``gpu-k25``: Kimi-K2.5's architecture in miniature, built and loaded as the release is (the release-shaped
  remote-code tokenizer, ``KimiK25ForConditionalGeneration`` around a DeepSeek-V3 text model): MLA at the release's
  head dims (q_lora 1536, kv_lora 512, qk_nope 128, qk_rope 64, v 128), a dense first layer, then MoE layers with a
  shared expert and top-6 routing over 64 experts, 163,840 vocabulary rows (~2 B parameters); GPU only.

The GPU sizes are what the speed measurements need (issue 46): a verifier whose decode step costs far more than a
draft's, as K2.5's does. Their rows past the tokenizer's ids are never a label; their logits are computed only where
a label is (the padded vocabulary would otherwise dominate the training step).

Beside the model it writes ``toy_verifier.json`` (ids and sizes the config needs, same keys as ``toy.py``) and
``toy_reasoning.json`` (recipe, seed, final loss, greedy accuracy on held-out questions, the rebuild command). A
folder whose ``toy_reasoning.json`` matches the requested recipe is reused, not retrained.

It also writes the task mix as chat datasets for the pipeline: ``--chats FILE`` (human-written answers, the
stage-01 input) and ``--eval-prompts FILE`` (held-out questions for stage 05, none of them in the training mix).

Usage::

    python -m eagle3pipe.toy_reasoning --size ci --out data/ci/verifier      # the shipped one (rebuild)
    python -m eagle3pipe.toy_reasoning --chats data/demo/chats.jsonl --eval-prompts data/demo/eval_prompts.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import toy
from .chat import load_tokenizer, prompt_token_ids, tokenize_with_loss_mask
from .records import atomic_write_json, write_jsonl_atomic
from .toy_tasks import Task, generate_tasks, human_chat_row, verifier_messages

log = logging.getLogger(__name__)

RECIPE_VERSION = 1  # bump when the task mix or training changes, so cached verifiers are rebuilt
# CPU training always uses one torch thread: float sums then do not depend on the machine's core count (the same CPU
# kind rebuilds the shipped weights bit for bit; other kinds: the same behaviour, a test pins it), and on a shared
# 2-core machine the toy's small ops ran 4-6x faster than with 2 threads, which wait on each other's time slices
CPU_TRAIN_THREADS = 1
TRAIN_SEED_OFFSET = 1000  # training tasks come from seed + this; held-out and chat-dataset tasks from other streams
HELD_OUT_SEED_OFFSET = 2000
CHATS_SEED_OFFSET = 3000


@dataclass(frozen=True)
class TrainRecipe:
    hidden_size: int  # model width
    intermediate_size: int  # MLP width
    num_attention_heads: int  # heads of 32 dims (vLLM CPU attention needs head_dim >= 32)
    num_key_value_heads: int
    num_layers: int  # decoder layers (aux layers then default to 2, n // 2, n - 3)
    num_train_tasks: int  # distinct training conversations
    steps: int  # optimizer steps
    batch_size: int  # packed rows per step
    seq_len: int  # tokens per packed row
    learning_rate: float  # peak AdamW learning rate (linear warm-up, cosine decay)
    # Fields added after recipe version 1: recorded only where a size sets them (_recipe_record), so the shipped
    # verifiers' records stay as they were written and their rebuild command still matches them.
    architecture: str = "llama"  # "llama", or "kimi_k25" (DeepSeek-V3 MLA + MoE, wrapped and tokenized as K2.5)
    vocab_rows: int = 0  # model vocabulary rows; 0 = the toy tokenizer's own (1088 llama, 1280 kimi_k25)
    q_lora_rank: int = 0  # kimi_k25: MLA query low-rank dim (K2.5: 1536); kv_lora 512 and head dims are the release's
    n_routed_experts: int = 0  # kimi_k25: routed experts per MoE layer (K2.5: 384)
    num_experts_per_tok: int = 0  # kimi_k25: experts each token is routed to (K2.5: 8)
    moe_intermediate_size: int = 0  # kimi_k25: MLP width of each expert and of the shared one (K2.5: 2048)


SIZES = {
    "ci": TrainRecipe(128, 256, 4, 2, 8, num_train_tasks=3000, steps=300, batch_size=4, seq_len=512,
                      learning_rate=3e-3),
    "bench": TrainRecipe(256, 512, 8, 4, 8, num_train_tasks=40000, steps=2500, batch_size=16, seq_len=1024,
                         learning_rate=1.5e-3),
    # GPU sizes: 8 packed rows of 1024 a step keep the fp32 weights, AdamW's moments, the activations and the
    # labeled positions' logits over 163,840 rows inside an H100's 80 GB
    "gpu-dense": TrainRecipe(2048, 8192, 32, 8, 16, num_train_tasks=40000, steps=1000, batch_size=8, seq_len=1024,
                             learning_rate=6e-4, vocab_rows=163840),
    "gpu-k25": TrainRecipe(2048, 8192, 16, 16, 12, num_train_tasks=40000, steps=1000, batch_size=8, seq_len=1024,
                           learning_rate=6e-4, architecture="kimi_k25", vocab_rows=163840, q_lora_rank=1536,
                           n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=256),
}


def _model_config(recipe: TrainRecipe):
    """toy.py's text config of the recipe's architecture (its tokenizer's ids) resized to the recipe: a Llama, or
    for kimi_k25 a DeepSeek-V3 at the release's MLA head dims with the recipe's MoE."""
    if recipe.architecture == "kimi_k25":
        cfg = toy.text_config("deepseek_v3", recipe.num_layers, release_tokenizer=True, mla_dims="release")
        cfg.num_key_value_heads = recipe.num_attention_heads  # MLA: one latent; transformers wants heads here
        cfg.q_lora_rank = recipe.q_lora_rank
        cfg.n_routed_experts = recipe.n_routed_experts
        cfg.num_experts_per_tok = recipe.num_experts_per_tok
        cfg.moe_intermediate_size = recipe.moe_intermediate_size
    else:
        cfg = toy.text_config("llama", recipe.num_layers)
        cfg.num_key_value_heads = recipe.num_key_value_heads
        cfg.head_dim = recipe.hidden_size // recipe.num_attention_heads
        assert cfg.head_dim >= 32, "vLLM CPU attention needs head_dim >= 32"
    cfg.hidden_size = recipe.hidden_size
    cfg.intermediate_size = recipe.intermediate_size
    cfg.num_attention_heads = recipe.num_attention_heads
    if recipe.vocab_rows:
        cfg.vocab_size = recipe.vocab_rows
    return cfg


def _is_kimi(recipe: TrainRecipe) -> bool:
    return recipe.architecture == "kimi_k25"


def _tokenize_chunk(args: tuple[str, bool, list[Task]]) -> list[tuple[list[int], list[int]]]:
    folder, remote_code, tasks = args
    tokenizer = load_tokenizer(folder, trust_remote_code=remote_code)
    return [tokenize_with_loss_mask(tokenizer, verifier_messages(t), thinking=True) for t in tasks]


def _tokenize_all(tokenizer, tasks: list[Task], folder: Path | None = None,
                  remote_code: bool = False) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) per task; many tasks are rendered in worker processes (the template is slow-ish)."""
    import os
    from concurrent.futures import ProcessPoolExecutor

    workers = min(16, os.cpu_count() or 1)
    if len(tasks) < 10000 or workers < 4 or folder is None:
        return [tokenize_with_loss_mask(tokenizer, verifier_messages(t), thinking=True) for t in tasks]
    chunk = -(-len(tasks) // workers)
    with ProcessPoolExecutor(workers) as pool:
        parts = pool.map(_tokenize_chunk, [(str(folder), remote_code, tasks[i:i + chunk])
                                           for i in range(0, len(tasks), chunk)])
        return [row for part in parts for row in part]


def held_out_tasks(n: int, seed: int, exclude: set[str]) -> list[Task]:
    """``n`` tasks from the held-out stream whose question text is not in ``exclude`` (the training questions)."""
    out: list[Task] = []
    for task in generate_tasks(4 * n + 64, seed + HELD_OUT_SEED_OFFSET):
        if task.question not in exclude:
            out.append(task)
            if len(out) == n:
                return out
    raise RuntimeError(f"could not draw {n} held-out questions distinct from the training mix")


def _pack(rows: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate conversations into rows of ``seq_len`` tokens: (input_ids [N, seq_len], labels [N, seq_len]).

    Packing wastes no compute on padding (2 CPU cores are the budget); a conversation attends to the ones packed
    before it, as in ordinary LM pre-training, which does not hurt learning these self-contained tasks.
    Labels are -100 off the assistant span, so only the verifier's own output is learned.
    """
    flat_ids: list[int] = []
    flat_labels: list[int] = []
    for ids, mask in rows:
        flat_ids.extend(ids)
        flat_labels.extend(t if m else -100 for t, m in zip(ids, mask))
    n_rows = max(1, len(flat_ids) // seq_len)
    pad = n_rows * seq_len - len(flat_ids)
    if pad > 0:
        flat_ids += [pad_id] * pad
        flat_labels += [-100] * pad
    input_ids = torch.tensor(flat_ids[: n_rows * seq_len]).view(n_rows, seq_len)  # [N, seq_len]
    labels = torch.tensor(flat_labels[: n_rows * seq_len]).view(n_rows, seq_len)  # [N, seq_len]
    return input_ids, labels


def _batches(input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int, gen: torch.Generator,
             device: torch.device):
    """Endless shuffled batches of packed rows: (input_ids [B, seq_len], labels [B, seq_len])."""
    while True:
        order = torch.randperm(input_ids.shape[0], generator=gen)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[start:start + batch_size]
            yield input_ids[idx].to(device), labels[idx].to(device)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, tasks: list[Task], max_new_tokens: int = 256) -> float:
    """Share of ``tasks`` whose greedy answer (text after </think>) contains the right result (one left-padded batch)."""
    model.eval()
    device = next(model.parameters()).device
    prompts = [prompt_token_ids(tokenizer, [{"role": "user", "content": t.question}], thinking=True) for t in tasks]
    width = max(map(len, prompts))
    pad_id = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)  # [B, width]
    attention_mask = (torch.arange(width, device=device)[None, :]
                      >= torch.tensor([width - len(p) for p in prompts], device=device)[:, None]).long()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=model.config.eos_token_id, pad_token_id=pad_id)
    correct = 0
    for task, seq in zip(tasks, out[:, width:].tolist()):
        text = tokenizer.decode(seq, skip_special_tokens=False)
        answer = text.split("</think>", 1)[1].split("<|im_end|>", 1)[0] if "</think>" in text else ""
        correct += task.result in answer
    model.train()
    return correct / max(1, len(tasks))


# the recipe fields of version 1: always recorded; later ones only where they differ from their default
RECIPE_V1_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_layers",
                    "num_train_tasks", "steps", "batch_size", "seq_len", "learning_rate")


def _recipe_record(size: str, recipe: TrainRecipe, seed: int) -> dict:
    defaults = TrainRecipe(*(0,) * len(RECIPE_V1_FIELDS))
    fields = {k: v for k, v in asdict(recipe).items() if k in RECIPE_V1_FIELDS or v != getattr(defaults, k)}
    return {"recipe_version": RECIPE_VERSION, "size": size, "seed": seed, "recipe": fields}


def is_cached(out_dir: Path, size: str, seed: int, recipe: TrainRecipe | None = None) -> bool:
    """True when ``out_dir`` holds a finished verifier trained with this exact recipe and seed."""
    meta_path = Path(out_dir) / "toy_reasoning.json"
    if not meta_path.is_file() or not (Path(out_dir) / "model.safetensors").is_file():
        return False
    meta = json.loads(meta_path.read_text())
    want = _recipe_record(size, recipe or SIZES[size], seed)
    return all(meta.get(k) == v for k, v in want.items())


def build_reasoning_verifier(out_dir: str | Path, size: str = "ci", seed: int = 0, device: str = "cpu",
                             steps: int | None = None, force: bool = False, max_minutes: float = 0.0,
                             recipe_overrides: dict | None = None, accuracy_questions: int = 16) -> Path:
    """Train (or reuse) the toy reasoning verifier of ``size`` in ``out_dir``; returns the folder.

    ``steps`` and ``recipe_overrides`` (TrainRecipe fields) change the recipe; the cache key records them.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (choose from {', '.join(SIZES)})")
    overrides = dict(recipe_overrides or {}, **({"steps": steps} if steps is not None else {}))
    recipe = TrainRecipe(**{**asdict(SIZES[size]), **overrides})
    out = Path(out_dir)
    if not force and is_cached(out, size, seed, recipe):
        log.info("toy reasoning verifier (%s, seed %d) already built in %s; reusing it", size, seed, out)
        return out
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    (out / "toy_reasoning.json").unlink(missing_ok=True)  # written last: its presence means "finished"
    threads_before = torch.get_num_threads()
    if torch.device(device).type == "cpu":
        torch.set_num_threads(CPU_TRAIN_THREADS)
    try:
        return _train(out, size, seed, device, recipe, max_minutes, accuracy_questions, started)
    finally:
        torch.set_num_threads(threads_before)


def _train(out: Path, size: str, seed: int, device: str, recipe: TrainRecipe, max_minutes: float,
           accuracy_questions: int, started: float) -> Path:
    from transformers import AutoModelForCausalLM

    kimi = _is_kimi(recipe)
    (toy.build_kimi_tokenizer if kimi else toy.build_tokenizer)(out)
    tokenizer = load_tokenizer(out, trust_remote_code=kimi)
    torch.manual_seed(seed)
    dev = torch.device(device)

    train_tasks = generate_tasks(recipe.num_train_tasks, seed + TRAIN_SEED_OFFSET)
    rows = _tokenize_all(tokenizer, train_tasks, out, remote_code=kimi)
    n_tokens = sum(len(ids) for ids, _ in rows)
    log.info("training %s toy reasoning verifier: %d conversations, %d tokens (mean %.0f), %d steps of %d on %s",
             size, len(rows), n_tokens, n_tokens / len(rows), recipe.steps, recipe.batch_size, dev)

    model = AutoModelForCausalLM.from_config(_model_config(recipe), dtype=torch.float32).to(dev)
    log.info("model: %s, %.3f B parameters (%.3f B in its layers)", type(model).__name__,
             sum(p.numel() for p in model.parameters()) / 1e9,
             sum(p.numel() for n, p in model.named_parameters() if ".layers." in n) / 1e9)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.01,
                            **({"fused": True} if dev.type == "cuda" else {}))
    warmup = max(1, recipe.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, recipe.steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(seed)
    packed_ids, packed_labels = _pack(rows, recipe.seq_len, tokenizer.pad_token_id)
    batches = _batches(packed_ids, packed_labels, recipe.batch_size, gen, dev)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu",
                                                                                                      enabled=False)
    model.train()
    losses: list[float] = []
    log_every = max(1, recipe.steps // 20)
    steps_done = 0
    for step in range(recipe.steps):
        if max_minutes and time.time() - started > 60 * max_minutes:
            log.warning("stopping at step %d of %d: --max-minutes %.1f reached (recorded in toy_reasoning.json)",
                        step, recipe.steps, max_minutes)
            break
        input_ids, labels = next(batches)
        with autocast:
            loss = _labeled_loss(model, input_ids, labels) if recipe.vocab_rows else \
                model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        steps_done = step + 1
        if (step + 1) % log_every == 0 or step + 1 == recipe.steps:
            recent = losses[-log_every:]
            log.info("step %d/%d loss %.4f lr %.2e elapsed %.0fs", step + 1, recipe.steps, sum(recent) / len(recent),
                     sched.get_last_lr()[0], time.time() - started)
    del opt  # its moments (2 x 4 bytes a parameter) before the model is copied to bf16
    train_s = time.time() - started

    exclude = {t.question for t in train_tasks}
    accuracy = None
    if accuracy_questions:
        accuracy = greedy_accuracy(model, tokenizer, held_out_tasks(accuracy_questions, seed, exclude))
        log.info("greedy accuracy on %d held-out questions: %.2f", accuracy_questions, accuracy)
    model = model.to("cpu", dtype=torch.bfloat16)
    model.config.dtype = "bfloat16"
    text_cfg = model.config
    if kimi:
        _save_as_release(model, out, seed)
    else:
        model.save_pretrained(str(out))  # one model.safetensors: ~1.5 MB (ci) / ~11 MB (bench) / 3.3 GB (gpu-dense)
    toy_meta = {
        "flavour": "kimi_k25" if kimi else "llama",
        "seed": seed,
        "num_layers": recipe.num_layers,
        "aux_layer_ids": toy.default_aux_layer_ids(recipe.num_layers),
        "think_token_id": tokenizer.convert_tokens_to_ids("<think>"),
        "response_token_id": tokenizer.convert_tokens_to_ids("</think>"),
        "hidden_size": recipe.hidden_size,
        "vocab_size": int(text_cfg.vocab_size),
    }
    if kimi:
        toy_meta["trust_remote_code"] = True  # its tokenizer is remote code, like the release's
    atomic_write_json(out / "toy_verifier.json", toy_meta)
    tail = losses[-max(1, recipe.steps // 20):]
    atomic_write_json(out / "toy_reasoning.json", {
        **_recipe_record(size, recipe, seed),
        "steps_done": steps_done,
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4),
        "held_out_greedy_accuracy": accuracy,
        "train_tokens": n_tokens,
        "device": str(dev),
        "cpu_threads": CPU_TRAIN_THREADS if dev.type == "cpu" else None,
        "torch": torch.__version__,
        "elapsed_s": round(time.time() - started, 1),
        **({"train_s": round(train_s, 1), "parameters": sum(p.numel() for p in model.parameters()),
            "device_name": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}),
        "rebuild_command": f"python -m eagle3pipe.toy_reasoning --size {size} --seed {seed} --out {out}"
                           + "".join(f" --set {k}={v}" for k, v in asdict(recipe).items()
                                     if v != getattr(SIZES[size], k))
                           + (" --device cuda" if dev.type == "cuda" else ""),
    })
    log.info("toy reasoning verifier (%s) written to %s in %.0fs", size, out, time.time() - started)
    return out


def _labeled_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss with the output layer applied only where the next token is a label: the same mean
    cross-entropy as ``model(input_ids, labels=labels).loss``, without [B, T, V] logits over a 163,840-row vocabulary
    (most positions of a packed row are prompts, whose labels are -100)."""
    hidden = model.model(input_ids=input_ids).last_hidden_state  # [B, T, H]
    targets = labels[:, 1:]  # [B, T - 1]: position t predicts token t + 1
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep])  # [N, V]
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


def _save_as_release(model, out: Path, seed: int) -> None:
    """A kimi_k25 verifier in the released K2.5 layout (toy.py's writer): the text model's per-expert tensors under
    ``language_model.``, a minimal vision tower, the wrapper config vLLM's KimiK25ForConditionalGeneration loads."""
    import tempfile

    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory(dir=out) as tmp:
        model.save_pretrained(tmp)  # the released per-expert names (may be several shards)
        text_tensors = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            text_tensors.update(load_file(str(shard)))
    toy.save_kimi_k25(out, text_tensors, model.config, seed, "bfloat16", save_file)


def write_chat_datasets(chats: Path | None, eval_prompts: Path | None, seed: int, size: str,
                        num_chats: int, num_eval: int) -> None:
    """Human-written chat dataset (stage 01 input) and held-out eval questions (stage 05), as JSONL ``messages``.

    Held-out questions are disjoint from the verifier's training questions and from the chat dataset's.
    """
    chat_tasks = generate_tasks(num_chats, seed + CHATS_SEED_OFFSET)
    if chats is not None:
        n = write_jsonl_atomic(Path(chats), (human_chat_row(t, f"toy-{i:06d}") for i, t in enumerate(chat_tasks)))
        log.info("wrote %d human-written chats to %s", n, chats)
    if eval_prompts is not None:
        exclude = {t.question for t in generate_tasks(SIZES[size].num_train_tasks, seed + TRAIN_SEED_OFFSET)}
        exclude |= {t.question for t in chat_tasks}
        rows = ({"id": f"eval-{i:05d}", "messages": [{"role": "user", "content": t.question}], "result": t.result}
                for i, t in enumerate(held_out_tasks(num_eval, seed, exclude)))
        n = write_jsonl_atomic(Path(eval_prompts), rows)
        log.info("wrote %d held-out eval prompts to %s", n, eval_prompts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train (or reuse) the toy reasoning verifier; write its chat datasets.")
    p.add_argument("--out", help="verifier folder (reused when it already holds this size and seed)")
    p.add_argument("--size", choices=sorted(SIZES), default="ci")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--steps", type=int, default=None, help="override the size's optimizer steps")
    p.add_argument("--num-train-tasks", type=int, default=None, help="override the size's training conversations")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any recipe field (TrainRecipe), e.g. --set hidden_size=64 to rehearse a GPU size on "
                        "a CPU; recorded in toy_reasoning.json and in the cache key")
    p.add_argument("--force", action="store_true", help="retrain even when a matching verifier exists")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop training after this wall time (0 = no cap)")
    p.add_argument("--chats", type=Path, help="write the human-written chat dataset (JSONL messages) here")
    p.add_argument("--num-chats", type=int, default=2000)
    p.add_argument("--eval-prompts", type=Path, help="write held-out evaluation questions (JSONL messages) here")
    p.add_argument("--num-eval", type=int, default=200)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.out:
        overrides = {"num_train_tasks": args.num_train_tasks} if args.num_train_tasks else {}
        fields = {f.name: f.type for f in dataclasses.fields(TrainRecipe)}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep or key not in fields:
                p.error(f"--set {item!r}: give FIELD=VALUE with FIELD one of {', '.join(fields)}")
            overrides[key] = value if fields[key] == "str" else (float(value) if fields[key] == "float" else int(value))
        build_reasoning_verifier(args.out, args.size, args.seed, args.device, args.steps, args.force,
                                 args.max_minutes, overrides)
    write_chat_datasets(args.chats, args.eval_prompts, args.seed, args.size, args.num_chats, args.num_eval)


if __name__ == "__main__":
    main()
