"""Benchmark stage 04 at Kimi-K2.5 draft dims: speculators' bare training step vs 04_train end to end from disk,
one plain process or torchrun (DDP).

1. bare: ``Eagle3DraftModel`` (hidden 7168, MLP 18432, 64 heads x 128, draft vocab 32000, verifier vocab 163840,
   SpecForge norm flags), one packed row of ``--tokens`` tokens (K2.5's train.total_seq_len, 32768, by default)
   already on the GPU, TTT 3, eager KL loss, fwd + bwd + clip + AdamW; flex attention under torch.compile (what
   run_train uses on CUDA).
2. e2e: ``04_train.py`` through its door reading stage-02-format files (records.save_hidden_states: [T, 4, H] bf16,
   or fp8 + scales) through speculators' ArrowDataset / CollateFn in DataLoader workers, per ``--storage``, once per
   ``--nproc`` launcher (0 = plain python, N = torchrun with N processes: DDP) on the same files. Enough samples are
   written for ``--skip-steps`` + ``--measure-steps`` at every launcher (``--samples 0``). Throughput is taken from
   checkpoints/metrics.jsonl between two logged steps after warm-up (tokens summed over ranks / elapsed), so
   compile and worker start-up are excluded. With --drop-cache (device only) the page cache is dropped before each
   e2e run.

3. ``--draft dflash`` (issue 31): the same for speculators' ``DFlashDraftModel`` at z-lab's K2.5 draft dims (6 Qwen3
   layers of 64 heads x 128, 8 KV heads, MLP 18432, block 8, reading 6 verifier states:
   configs/kimi_k25_dflash.yaml), ``--anchor-every`` 16 (total_seq_len / 16 blocks a row: train.dflash_max_anchors
   0), speculators' DFlash loss (ce, D-PACE), flex attention (its forward is torch.compile'd on CUDA). Besides row
   tokens/s it reports the supervised block slots a second (anchors x (block - 1)), which do not grow with the row
   length. ``--bare-tokens 8192 16384 32768`` is the row-length sweep (each length at its own anchors).

Usage (device): python bench/bench_train.py --work /tmp/bench --out $OUT
                python bench/bench_train.py --work /tmp/bench --out $OUT --skip bare --storage fp8 --nproc 0 1
                python bench/bench_train.py --draft dflash --work /tmp/bench --out $OUT --skip e2e \
                    --bare-tokens 8192 16384 32768 [--anchor-every 4]
       (CPU smoke, and 1 vs 2 gloo processes on the toy): python bench/bench_train.py --tiny --nproc 0 2
                                                          python bench/bench_train.py --tiny --draft dflash
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402

from eagle3pipe import draft  # noqa: E402
from eagle3pipe.config import load_config  # noqa: E402
from eagle3pipe.progress import setup_logging  # noqa: E402
from eagle3pipe.records import (  # noqa: E402
    DataDir,
    HiddenStatesManifest,
    read_jsonl,
    hs_file_metadata,
    hs_layer_ids,
    save_hidden_states,
    save_hs_manifest,
    save_hs_rows,
)
from eagle3pipe.records_vocab import VocabSummary, save_vocab  # noqa: E402

log = logging.getLogger("bench_train")
REPO = Path(__file__).resolve().parents[1]

K25 = dict(hidden=7168, inter=18432, heads=64, head_dim=128, draft_vocab=32000, vocab=163840, layers=61,
           dflash_layers=6, kv_heads=8, block=8)
TINY = dict(hidden=128, inter=256, heads=4, head_dim=64, draft_vocab=256, vocab=1088, layers=8,
            dflash_layers=2, kv_heads=2, block=8)
AUX = {("eagle3", False): [2, 30, 58], ("eagle3", True): [2, 4, 5],
       ("dflash", False): [2, 13, 25, 36, 48, 59], ("dflash", True): [1, 2, 4, 5, 6]}  # (draft, tiny): states read


def write_verifier(folder: Path, dims: dict) -> Path:
    """A Kimi-K2.5-shaped verifier shell: a kimi_k25 config.json with a nested DeepSeek-V3 text_config at ``dims``
    and only the three tensors the trainer reads (language_model.* embedding, final norm, lm_head), random bf16."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    text = {"model_type": "deepseek_v3", "hidden_size": dims["hidden"], "intermediate_size": dims["inter"],
            "num_hidden_layers": dims["layers"], "num_attention_heads": dims["heads"],
            "num_key_value_heads": dims["heads"], "vocab_size": dims["vocab"], "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "hidden_act": "silu",
            "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}}
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(0)
    h, v = dims["hidden"], dims["vocab"]
    save_file({
        "language_model.model.embed_tokens.weight": torch.randn(v, h, generator=g).to(torch.bfloat16),
        "language_model.lm_head.weight": (torch.randn(v, h, generator=g) / h**0.5).to(torch.bfloat16),
        "language_model.model.norm.weight": (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16),
    }, str(folder / "model.safetensors"))
    return folder


def write_data(data_dir: Path, verifier: Path, dims: dict, num_samples: int, lengths: tuple[int, int],
               storage: str, aux: list[int], device: str, prepared: bool = False) -> int:
    """Stage 02's output (random states, generated on ``device``) + a vocab/ of the first draft_vocab ids; with
    ``prepared`` also the rows as stage 01 writes them (prepared/data.jsonl: what 04 online reads)."""
    dd = DataDir(data_dir)
    g = torch.Generator().manual_seed(1)
    rows, tokens = [], 0
    for i in range(num_samples):
        t = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        ids = torch.randint(0, dims["vocab"], (t,), generator=g)
        states = torch.randn(t, len(aux) + 1, dims["hidden"], device=device, dtype=torch.bfloat16)
        save_hidden_states(dd.hs_file(i), states, ids, storage,
                           metadata=hs_file_metadata(hs_layer_ids(aux, dims["layers"]), dims["layers"]))
        rows.append((ids.tolist(), [0] * 16 + [1] * (t - 16)))
        tokens += t
    save_hs_rows(dd.hidden_states, rows)
    if prepared:
        dd.prepared.mkdir(parents=True, exist_ok=True)
        dd.prepared_data.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": mask,
                                                        "source": "bench"}) + "\n" for i, (ids, mask) in enumerate(rows)))
    save_hs_manifest(dd.hs_manifest, HiddenStatesManifest(
        verifier=str(verifier), num_layers=dims["layers"], aux_layer_ids=aux, hidden_size=dims["hidden"],
        model_dtype="bfloat16", storage_dtype=storage, num_samples=num_samples, num_tokens=tokens, num_dropped=0,
        bytes=sum(p.stat().st_size for p in dd.hs_files.glob("*.safetensors")), input="bench", config_hash="bench"))
    n, v = dims["draft_vocab"], dims["vocab"]
    sel = torch.randperm(v, generator=g)[:n].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[sel] = True
    save_vocab(dd, sel - torch.arange(n), t2d, torch.zeros(v, dtype=torch.int64),
               VocabSummary(source="data", draft_vocab_size=n, vocab_size=v, supervised_tokens=0, coverage=0.0,
                            mask_token="[UNK]", mask_token_id=v - 2))  # K2.5's [UNK] = 163838 (for --draft dflash)
    return tokens


def bare_step(verifier: Path, dims: dict, aux: list[int], tokens: int, steps: int, warmup: int,
              device: torch.device, train_lm_head: bool = False) -> dict:
    """speculators' own training step with data already on the device (``train_lm_head``: as train.train_lm_head)."""
    from speculators.losses import resolve_loss_config

    cfg_layer = draft.fresh_layer_config(verifier, dims["heads"], dims["heads"], dims["head_dim"], dims["inter"])
    n, v, h = dims["draft_vocab"], dims["vocab"], dims["hidden"]
    sel = torch.arange(0, v, v // n)[:n]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[sel] = True
    attn = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    model = draft.build_draft_model(cfg_layer, verifier=verifier, aux_layer_ids=aux, d2t=sel - torch.arange(n),
                                    t2d=t2d, ttt_steps=3, attn_impl=attn).to(device)
    model.lm_head.weight.requires_grad_(train_lm_head)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    kw = {"ttt_steps": 3, "ttt_step_loss_decay": 1.0, "loss_config": resolve_loss_config("kl_div", "eager")}
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    docs = torch.repeat_interleave(torch.arange(4), tokens // 4)[None].to(device)  # 4 packed documents
    batch = {"hidden_states": torch.randn(1, tokens, 3 * h, device=device, dtype=dt),
             "input_ids": torch.randint(0, v, (1, tokens), device=device), "document_ids": docs,
             "loss_mask": torch.ones(1, tokens, device=device, dtype=torch.long),
             "position_ids": torch.arange(1, tokens + 1, device=device)[None],
             "verifier_last_hidden_states": torch.randn(1, tokens, h, device=device, dtype=dt)}

    def one():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss, _ = model(**batch, **kw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        one()
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    sync()
    s = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    reserved = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else 0.0  # what an OOM meets
    del model, opt, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_ms": 1000 * s, "tokens_per_s": tokens / s, "warmup_s": warm_s, "peak_gib": peak,
            "peak_reserved_gib": reserved, "trainable_params": sum(p.numel() for p in params)}


def bare_step_dflash(verifier: Path, dims: dict, aux: list[int], tokens: int, steps: int, warmup: int,
                     device: torch.device, anchors: int = 0) -> dict:
    """speculators' DFlash training step with data already on the device: its model (built as 04 builds it), its
    loss (ce + D-PACE slot weights, eager), ``anchors`` blocks a row (0 = tokens / 16, as train.dflash_max_anchors)."""
    from eagle3pipe import draft_dflash

    anchors = draft_dflash.max_anchors(tokens, anchors)
    layer = draft_dflash.layer_config(verifier, num_layers=dims["dflash_layers"], num_heads=dims["heads"],
                                      head_dim=dims["head_dim"], num_kv_heads=dims["kv_heads"],
                                      intermediate_size=dims["inter"])
    n, v, h = dims["draft_vocab"], dims["vocab"], dims["hidden"]
    sel = torch.arange(0, v, v // n)[:n]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[sel] = True
    attn = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    model = draft_dflash.build_model(layer, verifier=verifier, layer_ids=aux, d2t=sel - torch.arange(n), t2d=t2d,
                                     block_size=dims["block"], mask_token_id=v - 2, attn_impl=attn).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    kw = draft_dflash.trainer_kwargs(loss="ce", position_weight="dpace", gamma=4.0, anchors=anchors)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    docs = torch.repeat_interleave(torch.arange(4), tokens // 4)[None].to(device)  # 4 packed documents
    batch = {"hidden_states": torch.randn(1, tokens, len(aux) * h, device=device, dtype=dt),
             "input_ids": torch.randint(0, v, (1, tokens), device=device), "document_ids": docs,
             "loss_mask": torch.ones(1, tokens, device=device, dtype=torch.long),
             "position_ids": (torch.arange(tokens, device=device) % (tokens // 4))[None],  # restart per document
             "verifier_last_hidden_states": torch.randn(1, tokens, h, device=device, dtype=dt)}
    gen = torch.Generator(device=device).manual_seed(0)

    def one():
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device=device)))  # anchors vary per step
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss, _ = model(**batch, **kw)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        one()
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    sync()
    s = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    reserved = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else 0.0
    del model, opt, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_ms": 1000 * s, "tokens_per_s": tokens / s, "anchors": anchors,
            "block_tokens_per_s": anchors * (dims["block"] - 1) / s, "warmup_s": warm_s, "peak_gib": peak,
            "peak_reserved_gib": reserved, "trainable_params": sum(p.numel() for p in params)}


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def samples_needed(tokens: int, steps: int, lengths: tuple[int, int], fill: float = 0.95) -> int:
    """Samples of ``lengths`` that pack into at least ``steps`` rows of ``tokens`` (rows fill 80-95 %: 95 % errs on more)."""
    return math.ceil(steps * tokens * fill / ((lengths[0] + lengths[1]) / 2)) + 1


def e2e(data_dir: Path, verifier: Path, dims: dict, aux: list[int], tokens: int, workers: int, device: str,
        skip_steps: int, drop_cache: bool, log_every: int, nproc: int = 0, storage: str = "bf16",
        overrides: dict | None = None, tag: str = "", draft_kind: str = "eagle3", anchor_every: int = 16) -> dict:
    """``04_train.py`` through its door on ``data_dir``: one plain process (``nproc`` 0) or torchrun with ``nproc``
    processes (DDP, one GPU each). Rates come from checkpoints/metrics.jsonl after ``skip_steps``. ``overrides``:
    config sections merged over these ({"train": {"data_source": "online"}, ...}); ``tag`` names its log/config."""
    values = {
        "shared": {"data_dir": str(data_dir), "verifier": str(verifier), "aux_layer_ids": aux,
                   "hidden_size": dims["hidden"], "vocab_size": dims["vocab"], "draft_vocab_size": dims["draft_vocab"],
                   "max_seq_len": tokens, "progress_every_s": 10.0},
        "train": {"epochs": 1, "total_seq_len": tokens, "eval_fraction": 0.0, "num_workers": workers,
                  "log_every": log_every, "checkpoint_every": 100000, "device": device, "draft_num_heads": dims["heads"],
                  "draft_head_dim": dims["head_dim"], "draft_intermediate_size": dims["inter"], "overwrite": True,
                  "cpu_threads": 1 if device == "cpu" else 0},
        "extract": {"storage_dtype": storage, "model_dtype": "bfloat16"},  # as write_data's manifest says
    }
    if draft_kind == "dflash":
        values["train"].update(draft="dflash", dflash_num_layers=dims["dflash_layers"],
                               dflash_num_kv_heads=dims["kv_heads"], dflash_block_size=dims["block"],
                               dflash_max_anchors=max(1, tokens // anchor_every))
    for section, keys in (overrides or {}).items():
        values[section].update(keys)
    cfg = load_config(None, values)
    cfg.validate("train")  # the checks 04 makes (shared.max_seq_len <= train.total_seq_len among them)
    config = data_dir.parent / f"{data_dir.name}_nproc{nproc}{tag}.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node", str(nproc)]
    dropped = drop_page_cache() if drop_cache else False
    out = data_dir.parent / f"{data_dir.name}_nproc{nproc}{tag}.log"
    t0 = time.perf_counter()
    with open(out, "wb") as f:
        code = subprocess.call(launcher + [str(REPO / "04_train.py"), "--config", str(config)], stdout=f,
                               stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - t0
    if code != 0:
        raise RuntimeError(f"04_train.py (nproc {nproc}) exited {code}; its output: {out}\n"
                           + out.read_text(errors="replace")[-3000:])
    rows = [r for r in read_jsonl(DataDir(data_dir).train_metrics) if r["kind"] == "train"]
    measured = [r for r in rows if r["step"] >= skip_steps]  # after compile and worker start-up
    if len(measured) < 2:
        raise SystemExit(f"error: {data_dir}: {rows[-1]['step'] if rows else 0} steps logged, too few to measure after "
                         f"--skip-steps {skip_steps}: raise --samples or --measure-steps")
    a, b = measured[0], measured[-1]
    steps = b["step"] - a["step"]
    elapsed = b["elapsed_s"] - a["elapsed_s"]
    rate = (b["tokens"] - a["tokens"]) / elapsed
    step_ms = 1000 * elapsed / steps
    world = max(nproc, 1)
    return {"nproc": nproc, "launcher": "plain" if nproc == 0 else f"torchrun x{nproc}",
            "tokens_per_s": rate, "step_ms": step_ms, "steps": b["step"], "measured_steps": steps,
            "measured_from_step": a["step"], "wall_s": wall, "page_cache_dropped": dropped,
            # packing fill: real tokens per packed row / row slots (a property of the data's lengths, not the loader)
            "packing_fill": (b["tokens"] - a["tokens"]) / (steps * tokens * world),
            "loader_wait_ms_per_step": 1000 * (b["loader_wait_s"] - a["loader_wait_s"]) / steps,
            "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy dims on CPU (smoke test of this script)")
    p.add_argument("--draft", choices=["eagle3", "dflash"], default="eagle3",
                   help="the draft family (train.draft): EAGLE-3 at K2.5 draft dims or z-lab's K2.5 DFlash dims")
    p.add_argument("--anchor-every", type=int, default=16,
                   help="dflash: one block per this many row tokens (16: speculators' 512 per 8192; 4 won on the toy)")
    p.add_argument("--work", default="/tmp/bench_train")
    p.add_argument("--out", default="")
    p.add_argument("--tokens", type=int, default=32768, help="packed-row length (train.total_seq_len; K2.5: 32768)")
    p.add_argument("--bare-tokens", type=int, nargs="+", default=[],
                   help="also run the bare step at each of these packed-row lengths (peak memory vs total_seq_len)")
    p.add_argument("--bare-lm-head", action="store_true",
                   help="in the --bare-tokens sweep, also run each length with the draft lm_head trained")
    p.add_argument("--samples", type=int, default=0,
                   help="samples per e2e dataset (0: enough for --skip-steps + --measure-steps at every --nproc)")
    p.add_argument("--measure-steps", type=int, default=8, help="e2e steps measured after --skip-steps")
    p.add_argument("--log-every", type=int, default=2, help="e2e metric lines every N steps (each line syncs)")
    p.add_argument("--skip-steps", type=int, default=4, help="e2e steps left out of the rate (compile, start-up)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--bare-steps", type=int, default=10)
    p.add_argument("--storage", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    p.add_argument("--nproc", type=int, nargs="+", default=[0],
                   help="e2e launchers, each on the same data: 0 = plain `python 04_train.py`, N = torchrun with N "
                        "processes (DDP; N GPUs, or gloo on CPU)")
    p.add_argument("--repeat", type=int, default=1, help="run the --nproc launchers this many times, interleaved")
    p.add_argument("--skip", choices=["none", "bare", "e2e"], default="none")
    p.add_argument("--drop-cache", action="store_true", help="drop the page cache before each e2e run (device only)")
    args = p.parse_args()
    setup_logging(None)
    dims = TINY if args.tiny else K25
    device = "cpu" if args.tiny else "cuda"
    tokens = 256 if args.tiny else args.tokens
    lengths = (40, 90) if args.tiny else (1200, 3000)
    aux = AUX[(args.draft, args.tiny)]
    work = Path(args.work)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    results: dict = {"draft": args.draft, "dims": dims, "aux_layer_ids": aux,
                     "tokens_per_row": tokens, "device": torch.cuda.get_device_name(0)
                     if device == "cuda" else "cpu", "torch": torch.__version__, "argv": sys.argv[1:]}

    def dump() -> None:
        if args.out:
            Path(args.out, "bench_train.json").write_text(json.dumps(results, indent=2) + "\n")

    t0 = time.perf_counter()
    verifier = write_verifier(work / "verifier", dims)
    log.info("verifier shell written in %.1fs", time.perf_counter() - t0)
    def bare(n: int, steps: int, warmup: int, lm_head: bool = False) -> dict:
        if args.draft == "dflash":
            return bare_step_dflash(verifier, dims, aux, n, steps, warmup, torch.device(device),
                                    max(1, n // args.anchor_every))
        return bare_step(verifier, dims, aux, n, steps, warmup, torch.device(device), lm_head)

    if args.skip != "bare":
        results["bare"] = bare(tokens, 3 if args.tiny else args.bare_steps, 2 if args.tiny else 4)
        log.info("bare: %s", results["bare"])
        dump()
    sweep = [(n, False) for n in args.bare_tokens] + [(n, True) for n in args.bare_tokens if args.bare_lm_head]
    for n, lm_head in sweep:  # train.total_seq_len sweep: one row of n tokens per step, OOM recorded, not fatal
        try:
            row = bare(n, 3 if args.tiny else 5, 2, lm_head)
        except torch.OutOfMemoryError as e:
            row = {"oom": str(e).splitlines()[0]}
            torch.cuda.empty_cache()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        key = f"{n}+lm_head" if lm_head else str(n)
        results.setdefault("bare_sweep", {})[key] = row
        log.info("bare %s tokens: %s", key, row)
        dump()
    if device == "cuda":
        torch.cuda.empty_cache()  # the e2e runs are other processes: leave them the GPU
    if args.skip != "e2e":
        steps = args.skip_steps + args.measure_steps + 1
        samples = args.samples or samples_needed(tokens, steps * max(max(args.nproc), 1), lengths)
        for storage in args.storage:
            data = work / f"data_{storage}"
            t0 = time.perf_counter()
            n_tok = write_data(data, verifier, dims, samples, lengths, storage, aux, device)
            log.info("%s data: %d samples, %d tokens written in %.1fs", storage, samples, n_tok,
                     time.perf_counter() - t0)
            workers = min(args.workers, 2) if args.tiny else args.workers
            for rep in range(args.repeat):
                for nproc in args.nproc:
                    key = f"e2e_{storage}" + (f"_nproc{nproc}" if nproc else "") + (f"_r{rep}" if rep else "")
                    results[key] = e2e(data, verifier, dims, aux, tokens, workers, device,
                                       skip_steps=args.skip_steps, drop_cache=args.drop_cache,
                                       log_every=args.log_every, nproc=nproc, storage=storage,
                                       draft_kind=args.draft, anchor_every=args.anchor_every)
                    results[key]["data_tokens"] = n_tok
                    results[key]["data_samples"] = samples
                    log.info("%s: %s", key, results[key])
                    dump()
            if 0 in args.nproc:  # DDP's cost: torchrun's tokens/s over the plain process's, same data, runs averaged
                def mean_rate(nproc: int) -> float:
                    runs = [e for k, e in results.items() if k.startswith(f"e2e_{storage}") and e["nproc"] == nproc]
                    return sum(e["tokens_per_s"] for e in runs) / len(runs)

                for nproc in sorted(set(args.nproc) - {0}):
                    results[f"ratio_{storage}_nproc{nproc}_to_plain"] = mean_rate(nproc) / mean_rate(0)
            shutil.rmtree(data, ignore_errors=True)
    if "bare" in results:
        for key, e in results.items():
            if key.startswith("e2e_") and e.get("nproc") == 0:
                e["tokens_per_s_ratio_to_bare"] = e["tokens_per_s"] / results["bare"]["tokens_per_s"]
                e["step_time_ratio_bare_over_e2e"] = results["bare"]["step_ms"] / e["step_ms"]  # loader speed
    text = json.dumps(results, indent=2)
    print(text)
    dump()


if __name__ == "__main__":
    main()
