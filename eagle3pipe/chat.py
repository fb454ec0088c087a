"""Chat rendering and token ids: the one place that knows the chat template, the special ids and the loss mask.

Everything is rendered with the verifier tokenizer's own chat template (never a hand-written one), and the
assistant-only loss mask is derived from that same rendering: for each assistant turn, the text the template adds
after the generation prompt (``...<|im_assistant|>assistant<|im_middle|><think>``) up to and including its
``<|im_end|>`` is supervised; everything else (system, user, tool turns, role headers) is not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

THINK_TOKEN = "<think>"
RESPONSE_TOKEN = "</think>"
END_OF_TURN_TOKEN = "<|im_end|>"

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class ChatError(ValueError):
    """A conversation that cannot be rendered or trained on; the message says why (it lands in errors.jsonl)."""


class TokenIdMismatch(ValueError):
    """The config's special ids disagree with the tokenizer's."""


@dataclass(frozen=True)
class SpecialIds:
    think: int  # <think>
    response: int  # </think>
    end_of_turn: int  # <|im_end|>


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer folder not found: {path} (set --verifier or --tokenizer)")
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    if not getattr(tok, "chat_template", None):
        raise ChatError(f"tokenizer at {path} has no chat_template; the pipeline renders with the model's own template")
    return tok


def resolve_special_ids(tokenizer: PreTrainedTokenizerBase, think_token_id: int, response_token_id: int) -> SpecialIds:
    """Look up <think>, </think>, <|im_end|> in the tokenizer and cross-check them against the configured ids."""
    found = {}
    for name in (THINK_TOKEN, RESPONSE_TOKEN, END_OF_TURN_TOKEN):
        tid = tokenizer.convert_tokens_to_ids(name)
        if tid is None or tid == tokenizer.unk_token_id:
            raise TokenIdMismatch(f"tokenizer has no token {name!r}; is this a Kimi-style reasoning tokenizer?")
        found[name] = tid
    for name, configured, key in (
        (THINK_TOKEN, think_token_id, "think_token_id"),
        (RESPONSE_TOKEN, response_token_id, "response_token_id"),
    ):
        if found[name] != configured:
            raise TokenIdMismatch(
                f"config shared.{key} = {configured} but the tokenizer maps {name!r} to {found[name]}; "
                f"fix --{key.replace('_', '-')} (or the config file) to match the verifier's tokenizer"
            )
    return SpecialIds(think=found[THINK_TOKEN], response=found[RESPONSE_TOKEN], end_of_turn=found[END_OF_TURN_TOKEN])


def normalize_messages(example: dict) -> list[dict]:
    """Turn one dataset row into [{"role", "content"}] with canonical roles.

    Accepts OpenAI ``messages`` (role/content) and ShareGPT / open-perfectblend ``conversations`` (from/value).
    Raises ChatError naming what is wrong.
    """
    if "messages" in example and example["messages"] is not None:
        turns, role_key, content_key = example["messages"], "role", "content"
    elif "conversations" in example and example["conversations"] is not None:
        turns = example["conversations"]
        role_key, content_key = ("from", "value") if turns and "from" in turns[0] else ("role", "content")
    else:
        raise ChatError(f"no 'messages' or 'conversations' column (row has: {', '.join(sorted(example))})")
    if not isinstance(turns, list) or not turns:
        raise ChatError("conversation is empty")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise ChatError(f"turn {i} lacks '{role_key}'/'{content_key}'")
        raw_role = str(turn[role_key]).strip().lower()
        role = ROLE_ALIASES.get(raw_role)
        if role is None:
            raise ChatError(f"turn {i} has unknown role {turn[role_key]!r}")
        content = turn[content_key]
        if not isinstance(content, str):
            raise ChatError(f"turn {i} content is {type(content).__name__}, not text")
        messages.append({"role": role, "content": content})
    if messages[0]["role"] == "system" and len(messages) == 1:
        raise ChatError("conversation holds only a system turn")
    if not any(m["role"] == "user" for m in messages):
        raise ChatError("conversation has no user turn")
    return messages


def question_messages(messages: list[dict]) -> list[dict]:
    """The prompt stage 01b sends: the conversation cut at (and including) its last user turn."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: last_user + 1]


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, add_generation_prompt: bool,
           thinking: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, thinking=thinking
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize rendered chat text exactly as vLLM's chat endpoint does (no extra BOS: the template holds it)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_with_loss_mask(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *,
                            thinking: bool) -> tuple[list[int], list[int]]:
    """Render ``messages`` with the template; return (input_ids, loss_mask) with 1 on assistant-generated tokens.

    An assistant turn's supervised span is what the template renders after the generation prompt of the
    conversation before it, through the end of that turn: the tokens the model itself would produce.
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError("conversation has no assistant turn to train on")
    full = render(tokenizer, messages, add_generation_prompt=False, thinking=thinking)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:i], add_generation_prompt=True, thinking=thinking) if i else ""
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False, thinking=thinking)
        if not full.startswith(upto) or not upto.startswith(prefix):
            raise ChatError(
                f"chat template does not render turn {i} as a prefix of the whole conversation; "
                "cannot locate the assistant span"
            )
        spans.append((len(prefix), len(upto)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = enc["input_ids"]
    loss_mask = [0] * len(input_ids)
    for t, (start, end) in enumerate(enc["offset_mapping"]):
        if end <= start:
            continue
        for s_start, s_end in spans:
            if start >= s_start and end <= s_end:
                loss_mask[t] = 1
                break
            if start < s_end and end > s_start:
                raise ChatError(f"token {t} straddles an assistant span boundary; tokenizer merges across turns")
    if not any(loss_mask):
        raise ChatError("no assistant token survived tokenization")
    return input_ids, loss_mask


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, thinking: bool) -> list[int]:
    """Prompt ids as the server builds them: the template with the generation prompt (ends with <think> if thinking)."""
    return encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True, thinking=thinking))


def rebuild_completion_ids(tokenizer: PreTrainedTokenizerBase, ids: SpecialIds, reasoning: str | None,
                           content: str | None, *, finished: bool) -> list[int]:
    """Completion ids from text when a server returned none: reasoning + </think> + content + <|im_end|>.

    The prompt already ends with <think> (thinking on), so the completion starts with the reasoning tokens.
    ``finished`` (finish_reason == "stop") appends the end-of-turn id the model emitted.
    """
    out = encode(tokenizer, reasoning) if reasoning else []
    if content is not None:
        out = out + [ids.response] + encode(tokenizer, content)
    if finished:
        out.append(ids.end_of_turn)
    return out
