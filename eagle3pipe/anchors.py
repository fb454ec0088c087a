"""Published figures of public Kimi drafts, acceptance lengths and wall-clock speedups: the one table stage 05's
report puts beside ours and docs/stages/05_evaluate.md shows (tests/test_docs.py checks the page against it), each
figure with where it was read and the settings it was measured at: acceptance lengths depend on the prompts and k,
wall-clock speedups on the engine, the GPUs, the batch and the output length.

Acceptance length here is ours: tokens per verify step, the bonus token included (SGLang's ``accept_length`` and
vLLM's "mean acceptance length"). SGLang's "steps 3, topk 1, num_draft_tokens 4" is k = 3 draft tokens a step (its
draft-token count includes the token being verified), vLLM's ``num_speculative_tokens`` 3. Other harnesses on other
targets with their own prompts and lengths: the same measure, not the same experiment.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Anchor:
    draft: str  # the Hugging Face id of the published draft
    target: str  # the model it drafts for
    source: str  # where the figures were read
    settings: str  # how they were measured
    acceptance_length: dict[str, float] = field(default_factory=dict)  # benchmark set (eval_sets' name) -> figure
    k: int = 3  # draft tokens a verify step


ANCHORS: tuple[Anchor, ...] = (
    Anchor("lightseekorg/kimi-k2.5-eagle3", "Kimi-K2.5",
           "its model card (phase 2, 40 k steps): https://huggingface.co/lightseekorg/kimi-k2.5-eagle3",
           "k = 3 (steps 3, topk 1, 4 draft tokens), SpecForge bench_eagle3.py on SGLang, n = 80 / 500 / 164 / 500; "
           "TorchSpec-trained on K2.5-regenerated data",
           {"mtbench": 2.687, "gsm8k": 3.201, "humaneval": 3.285, "math500": 3.342}),
    Anchor("lightseekorg/kimi-k2.5-eagle3-mla", "Kimi-K2.5",
           "its model card: https://huggingface.co/lightseekorg/kimi-k2.5-eagle3-mla",
           "k = 3, vLLM with lm_eval; an MLA draft layer (2 phases of ~14 h, 16 H200 training + 16 serving)",
           {"mtbench": 2.940, "gsm8k": 3.017, "humaneval": 2.969, "math500": 3.051}),
    Anchor("AQ-MedAI/Kimi-K2-Instruct-eagle3", "Kimi-K2 (not K2.5)",
           "its model card's table, the \"MLA\" column: https://huggingface.co/AQ-MedAI/Kimi-K2-Instruct-eagle3",
           "k = 3 (steps 3, topk 1, 4 draft tokens), SGLang",
           {"gsm8k": 3.165, "humaneval": 3.372, "math500": 3.490}),
    Anchor("z-lab/Kimi-K2.5-DFlash", "Kimi-K2.5",
           "its model card: https://huggingface.co/z-lab/Kimi-K2.5-DFlash",
           "DFlash block 8 = k 7, thinking on, temperature 0, top-k 1, 2048 new tokens, concurrency 1, first turn "
           "only, SGLang's spec_accept_length",
           {"mtbench": 3.7, "gsm8k": 5.3, "humaneval": 5.3, "math500": 5.5}, k=7),
)


def acceptance_anchors(set_names: list[str], k: int, draft_ks: set[int] = frozenset()) -> list[dict]:
    """The anchors' published figures for the sets measured that they report (by known benchmark name), each with
    its settings; a note when our k (the exported draft's) is not theirs (then the figures do not compare). A
    DFlash anchor (k other than 3) is listed only when some draft (``draft_ks``, with ``k``) ran at its k."""
    out = []
    for anchor in ANCHORS:
        theirs = anchor.k
        if theirs != 3 and theirs not in {k, *draft_ks}:  # a DFlash draft's figures: beside one at its k only
            continue
        figures = {name: anchor.acceptance_length[name] for name in set_names if name in anchor.acceptance_length}
        if figures:
            out.append({"draft": anchor.draft, "target": anchor.target, "settings": anchor.settings,
                        "source": anchor.source, "acceptance_length": figures, "num_speculative_tokens": theirs,
                        "note": "" if k == theirs else f"measured at k = {theirs}, ours at k = {k}: not comparable"})
    return out


@dataclass(frozen=True)
class WallClock:
    draft: str  # the draft (a published id, or what its source names)
    target: str  # the model it drafts for
    engine: str  # the serving engine and version
    hardware: str  # the GPUs
    concurrency: int  # requests in flight (their batch size)
    speedup: float  # output tokens/s with the draft over the same server without it (their ratio or percentage + 1)
    detail: str  # the figures behind the ratio
    source: str  # where they were read
    input_tokens: int | None = None  # prompt and output lengths, where given
    output_tokens: int | None = None


THIRD_PARTY = "third-party benchmark (shared/REFERENCE.md)"
WALL_CLOCK: tuple[WallClock, ...] = (
    WallClock("EAGLE-3 MLA, k = 3", "Kimi-K2.5 INT4", "vLLM 0.21.0", "8 x H200", 16, 1.23,
              "1,421 vs 1,157 output tok/s (TPOT 13.6 ms without the draft), 200 requests", THIRD_PARTY, 1024, 512),
    WallClock("EAGLE-3 MLA, k = 3", "Kimi-K2.5 INT4", "vLLM 0.21.0", "8 x H200", 16, 1.43,
              "1,521 vs 1,067 output tok/s, 200 requests", THIRD_PARTY, 1024, 2048),
    WallClock("DFlash, k = 3", "Kimi-K2.5 INT4", "vLLM 0.21.0", "8 x H200", 16, 1.16,
              "1,339 vs 1,157 output tok/s", THIRD_PARTY, 1024, 512),
    WallClock("DFlash, k = 3", "Kimi-K2.5 INT4", "vLLM 0.21.0", "8 x H200", 16, 1.36,
              "1,447 vs 1,067 output tok/s", THIRD_PARTY, 1024, 2048),
    WallClock("DFlash, k = 8", "Kimi-K2.5 INT4", "vLLM 0.21.0", "8 x H200", 16, 0.97,
              "1,127 vs 1,157 output tok/s (attributed to max_num_scheduled_tokens 1024)", THIRD_PARTY, 1024, 512),
    WallClock("lightseekorg/kimi-k2.6-eagle3.1-mla", "Kimi-K2.6 NVFP4", "vLLM", "4 x GB200 (TP 4)", 1, 2.03,
              "per-user output throughput", "vLLM blog, 2026-05-26"),
    WallClock("TorchSpec's K2.5 EAGLE-3", "Kimi-K2.5", "not stated", "not stated", 1, 1.60, "+60 % at batch 1",
              "TorchSpec's K2.5 blog"),
    WallClock("TorchSpec's K2.5 EAGLE-3", "Kimi-K2.5", "not stated", "not stated", 8, 1.30, "+30 % at batch 8",
              "TorchSpec's K2.5 blog"),
    WallClock("TorchSpec's K2.5 EAGLE-3", "Kimi-K2.5", "not stated", "not stated", 16, 1.26, "+26 % at batch 16",
              "TorchSpec's K2.5 blog"),
)


def wall_clock_settings(anchor: dict) -> str:
    """One line of a wall-clock anchor's settings (a WallClock as the report stores it): engine, hardware,
    concurrency, lengths, the figures and their source."""
    lengths = (f", {anchor['input_tokens']} in / {anchor['output_tokens']} out" if anchor.get("output_tokens")
               else "")
    return (f"{anchor['engine']}, {anchor['hardware']}, concurrency {anchor['concurrency']}{lengths}; "
            f"{anchor['detail']} ({anchor['source']})")
