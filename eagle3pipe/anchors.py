"""Published figures of public Kimi drafts: the one table stage 05's report and the docs quote beside ours.

Each entry keeps its settings (engine, hardware, concurrency, lengths), because a figure read without them misleads:
acceptance lengths depend on the prompts and k, wall-clock speedups on the engine, the batch and the output length.
Sources and details: shared/REFERENCE.md ("Anchor figures"). A docs test checks that the pages quote these numbers.
"""

from __future__ import annotations

# Acceptance length at SGLang's "steps 3, topk 1, num_draft_tokens 4" = k 3 draft tokens, with the bonus token,
# as ours; an entry with its own "k" is a DFlash draft's (its block size - 1).
ACCEPTANCE = [
    {"draft": "lightseekorg/kimi-k2.5-eagle3", "target": "Kimi-K2.5",
     "settings": "k = 3 (steps 3, topk 1, 4 draft tokens), TorchSpec-trained on K2.5-regenerated data",
     "acceptance_length": {"mtbench": 2.69, "gsm8k": 3.20, "humaneval": 3.29, "math500": 3.34}},
    {"draft": "lightseekorg/kimi-k2.5-eagle3-mla", "target": "Kimi-K2.5",
     "settings": "k = 3 (topk 1, 3 steps, 4 draft tokens), an MLA draft (train.draft eagle3_mla's family), vLLM, "
                 "lm_eval's prompts; TorchSpec-trained on K2.5-regenerated data",
     "acceptance_length": {"mtbench": 2.940, "gsm8k": 3.017, "humaneval": 2.969, "math500": 3.051}},
    {"draft": "AQ-MedAI/Kimi-K2-Instruct-eagle3", "target": "Kimi-K2 (not K2.5)",
     "settings": "k = 3 (steps 3, topk 1, 4 draft tokens), SGLang",
     "acceptance_length": {"mtbench": 2.39, "gsm8k": 3.27, "humaneval": 3.36, "math500": 3.47}},
    {"draft": "z-lab/Kimi-K2.5-DFlash", "target": "Kimi-K2.5", "k": 7,
     "settings": "DFlash block 8 = k 7, thinking on, greedy, 2048 new tokens, concurrency 1, SGLang",
     "acceptance_length": {"mtbench": 3.7, "gsm8k": 5.3, "humaneval": 5.3, "math500": 5.5}},
]
ACCEPTANCE_K = 3  # the EAGLE-3 anchors' k

# Output tokens/s with the draft over the same server without it, as published. "speedup" is theirs (a ratio, or
# their percentage + 1); "concurrency" the requests in flight (their batch size).
WALL_CLOCK = [
    {"draft": "EAGLE-3 MLA, k = 3", "target": "Kimi-K2.5 INT4", "engine": "vLLM 0.21.0", "hardware": "8 x H200",
     "concurrency": 16, "input_tokens": 1024, "output_tokens": 512, "speedup": 1.23,
     "detail": "1,421 vs 1,157 output tok/s (TPOT 13.6 ms without the draft), 200 requests",
     "source": "third-party benchmark (shared/REFERENCE.md)"},
    {"draft": "EAGLE-3 MLA, k = 3", "target": "Kimi-K2.5 INT4", "engine": "vLLM 0.21.0", "hardware": "8 x H200",
     "concurrency": 16, "input_tokens": 1024, "output_tokens": 2048, "speedup": 1.43,
     "detail": "1,521 vs 1,067 output tok/s, 200 requests", "source": "third-party benchmark (shared/REFERENCE.md)"},
    {"draft": "DFlash, k = 3", "target": "Kimi-K2.5 INT4", "engine": "vLLM 0.21.0", "hardware": "8 x H200",
     "concurrency": 16, "input_tokens": 1024, "output_tokens": 512, "speedup": 1.16,
     "detail": "1,339 vs 1,157 output tok/s", "source": "third-party benchmark (shared/REFERENCE.md)"},
    {"draft": "DFlash, k = 3", "target": "Kimi-K2.5 INT4", "engine": "vLLM 0.21.0", "hardware": "8 x H200",
     "concurrency": 16, "input_tokens": 1024, "output_tokens": 2048, "speedup": 1.36,
     "detail": "1,447 vs 1,067 output tok/s", "source": "third-party benchmark (shared/REFERENCE.md)"},
    {"draft": "DFlash, k = 8", "target": "Kimi-K2.5 INT4", "engine": "vLLM 0.21.0", "hardware": "8 x H200",
     "concurrency": 16, "input_tokens": 1024, "output_tokens": 512, "speedup": 0.97,
     "detail": "1,127 vs 1,157 output tok/s (attributed to max_num_scheduled_tokens 1024)",
     "source": "third-party benchmark (shared/REFERENCE.md)"},
    {"draft": "lightseekorg/kimi-k2.6-eagle3.1-mla", "target": "Kimi-K2.6 NVFP4", "engine": "vLLM",
     "hardware": "4 x GB200 (TP 4)", "concurrency": 1, "input_tokens": None, "output_tokens": None, "speedup": 2.03,
     "detail": "per-user output throughput", "source": "vLLM blog, 2026-05-26"},
    {"draft": "TorchSpec's K2.5 EAGLE-3", "target": "Kimi-K2.5", "engine": "not stated", "hardware": "not stated",
     "concurrency": 1, "input_tokens": None, "output_tokens": None, "speedup": 1.60, "detail": "+60 % at batch 1",
     "source": "TorchSpec's K2.5 blog"},
    {"draft": "TorchSpec's K2.5 EAGLE-3", "target": "Kimi-K2.5", "engine": "not stated", "hardware": "not stated",
     "concurrency": 8, "input_tokens": None, "output_tokens": None, "speedup": 1.30, "detail": "+30 % at batch 8",
     "source": "TorchSpec's K2.5 blog"},
    {"draft": "TorchSpec's K2.5 EAGLE-3", "target": "Kimi-K2.5", "engine": "not stated", "hardware": "not stated",
     "concurrency": 16, "input_tokens": None, "output_tokens": None, "speedup": 1.26, "detail": "+26 % at batch 16",
     "source": "TorchSpec's K2.5 blog"},
]


def acceptance_anchors(set_names: list[str], k: int, draft_ks: set[int] = frozenset()) -> list[dict]:
    """The published acceptance lengths for the sets measured that they report (by known benchmark name), each
    with its settings; a note when our k (the exported draft's) is not theirs (then the figures do not compare). A
    DFlash anchor (its own "k") is listed only when some draft (``draft_ks``, with ``k``) ran at its k."""
    out = []
    for anchor in ACCEPTANCE:
        theirs = anchor.get("k", ACCEPTANCE_K)
        if "k" in anchor and theirs not in {k, *draft_ks}:
            continue
        figures = {name: anchor["acceptance_length"][name] for name in set_names if name in anchor["acceptance_length"]}
        if figures:
            out.append({**{key: anchor[key] for key in ("draft", "target", "settings")}, "acceptance_length": figures,
                        "num_speculative_tokens": theirs,
                        "note": "" if k == theirs else f"measured at k = {theirs}, ours at k = {k}: not comparable"})
    return out


def wall_clock_settings(anchor: dict) -> str:
    """One line of an anchor's settings: engine, hardware, concurrency, lengths."""
    lengths = (f", {anchor['input_tokens']} in / {anchor['output_tokens']} out" if anchor.get("output_tokens")
               else "")
    return (f"{anchor['engine']}, {anchor['hardware']}, concurrency {anchor['concurrency']}{lengths}; "
            f"{anchor['detail']} ({anchor['source']})")
