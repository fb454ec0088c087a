"""Published acceptance lengths of public Kimi-K2 / K2.5 drafts: the one table stage 05's report puts beside ours
and docs/stages/05_evaluate.md shows (tests/test_docs.py checks the page against it), each figure with where it was
read and the settings it was measured at.

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
