"""Acceptance arithmetic of stage 05: the report's figures from counts of verify steps and accepted draft tokens.

- acceptance length = 1 + accepted / drafts: the mean number of tokens one verify step emits (the bonus token the
  verifier always adds, plus the accepted draft tokens); vLLM's "mean acceptance length", SGLang's accept_length;
- per-position acceptance = accepted at position i / drafts: the chance that draft token i (and all before it) is
  accepted;
- draft acceptance rate = accepted / draft tokens.

Counts come from each response's own ``metrics.speculative_decoding`` (vLLM >= 0.32 with
``--per-request-spec-decode-metrics``) or from two ``/metrics`` scrapes; several passes are pooled by adding their
counts, never by averaging their rates.
"""

from __future__ import annotations

from .vllm_client import ServerMetrics


def acceptance_figures(drafts: int, draft_tokens: int, accepted: int, per_position: list[int]) -> dict:
    """The report's acceptance figures from counts (see the module docstring for the definitions)."""
    return {
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "accepted_per_position": [int(x) for x in per_position],
        "acceptance_length": round(1.0 + accepted / drafts, 4) if drafts > 0 else None,
        "acceptance_length_definition": "1 + accepted / drafts (mean tokens emitted per verify step)",
        "per_position_acceptance": [round(x / drafts, 4) for x in per_position] if drafts > 0 else [],
        "draft_acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens > 0 else None,
    }


def per_request_delta(stats: list[dict]) -> dict:
    """Acceptance figures summed over responses' own ``metrics.speculative_decoding`` (vLLM >= 0.32): verify steps
    (``num_spec_steps``), drafted and accepted tokens, and per position i the steps that accepted more than i
    drafts (from ``acceptance_histogram``: entry j = steps that accepted exactly j)."""
    k = max(int(st["num_spec_tokens"]) for st in stats)
    per_position = [0] * k
    for st in stats:
        hist = st["acceptance_histogram"]
        for i in range(k):
            per_position[i] += sum(hist[i + 1:])
    return acceptance_figures(sum(int(st["num_spec_steps"]) for st in stats),
                              sum(int(st["num_draft_tokens"]) for st in stats),
                              sum(int(st["num_accepted_draft_tokens"]) for st in stats), per_position)


def pooled_figures(parts: list[dict]) -> dict:
    """Acceptance figures of several passes together: their counts added, then divided (never rates averaged)."""
    k = max(len(p["accepted_per_position"]) for p in parts)
    per_position = [sum(p["accepted_per_position"][i] for p in parts if i < len(p["accepted_per_position"]))
                    for i in range(k)]
    return acceptance_figures(sum(p["drafts"] for p in parts), sum(p["draft_tokens"] for p in parts),
                              sum(p["accepted_tokens"] for p in parts), per_position)


def spec_decode_delta(before: ServerMetrics, after: ServerMetrics) -> dict:
    """Acceptance figures from two /metrics scrapes (see the module docstring for the definitions)."""
    drafts = after.spec_decode_drafts - before.spec_decode_drafts
    draft_tokens = after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    accepted = after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens
    pos_after, pos_before = after.spec_decode_accepted_per_position(), before.spec_decode_accepted_per_position()
    pos_before = pos_before + [0.0] * (len(pos_after) - len(pos_before))
    per_position = [a - b for a, b in zip(pos_after, pos_before)]
    return acceptance_figures(drafts, draft_tokens, accepted, per_position)
