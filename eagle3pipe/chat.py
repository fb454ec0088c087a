"""Chat rendering and token ids: the one place that knows the chat template, the special ids and the loss mask.

Everything is rendered with the verifier tokenizer's own chat template (never a hand-written one), and the
assistant-only loss mask is derived from that same rendering: for each assistant turn, the text the template adds
after the generation prompt (``...<|im_assistant|>assistant<|im_middle|><think>``) up to and including its
``<|im_end|>`` is supervised; everything else (system, user, tool turns, role headers) is not.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The verifier's own tokenizer. Kimi-K2.5's is remote code (``tokenization_kimi.py`` over ``tiktoken.model``,
    named in tokenizer_config.json's ``auto_map``): it needs ``trust_remote_code`` (``shared.trust_remote_code``)."""
    # imported here: AutoTokenizer pulls in transformers' model machinery (~3 s), which a stage without a
    # tokenizer (02, 03, 04) should not pay at every start because the stage door imports this module's errors
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer folder not found: {path} (set --verifier or --tokenizer)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise ChatError(f"the tokenizer at {path} is remote code (auto_map in tokenizer_config.json, like "
                            "Kimi-K2.5's tiktoken tokenizer): set shared.trust_remote_code: true "
                            "(flag --trust-remote-code) to load it as the model's authors wrote it") from None
        # Whatever the tokenizer's files or its remote code raise (a KeyError from a missing special, a corrupt
        # vocabulary file, an import error): one line naming the folder, for the stage's `error:` line.
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise ChatError(f"the tokenizer at {path} failed to load: {reason}") from e
    if (path / "tiktoken.model").exists() and tok.is_fast and not (path / "tokenizer.json").exists():
        # transformers converted tiktoken.model itself, with a generic split regex: ids differ from the model's
        # on code and CJK text, silently. Only the folder's own tokenizer code splits text the model's way.
        raise ChatError(f"{path} holds tiktoken.model but was loaded as a fast tokenizer converted by transformers "
                        f"({type(tok).__name__}), whose pre-tokenizer is not the model's: load its remote code with "
                        "shared.trust_remote_code: true")
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


def _text_content(content, where: str) -> str:
    """A message's content as text: a string, or a list of text parts joined (how the template renders them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ChatError(f"{where} has a content part of type {kind!r}: the pipeline is text-only")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatError(f"{where} content is {type(content).__name__}, not text")


def _tool_calls(calls, where: str) -> list[dict]:
    """OpenAI-format tool calls, with ``arguments`` parsed into an object, as vLLM's chat endpoint hands them to the
    template (a JSON string there is parsed, then rendered by ``tojson``): so 01 and the server render the same."""
    if not isinstance(calls, list) or not calls:
        raise ChatError(f"{where} tool_calls must be a non-empty list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str):
            raise ChatError(f"{where} tool call {j} lacks id / function.name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ChatError(f"{where} tool call {j} arguments are not valid JSON ({e.msg})") from None
        if not isinstance(args, dict):
            raise ChatError(f"{where} tool call {j} arguments are {type(args).__name__}, not a JSON object")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_messages(example: dict) -> list[dict]:
    """Turn one dataset row into chat messages with canonical roles: ``role`` and ``content`` (text), plus what the
    template renders of tool use (``tool_calls`` on assistant turns, ``tool_call_id`` on tool turns) and ``name``.

    Accepts OpenAI ``messages`` (role/content, tool calls with ``content: null``) and ShareGPT / open-perfectblend
    ``conversations`` (from/value). Reasoning fields are not kept (01b regenerates reasoning). Raises ChatError
    naming what is wrong.
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
        where = f"turn {i}"
        if not isinstance(turn, dict) or role_key not in turn or (content_key not in turn and not turn.get("tool_calls")):
            raise ChatError(f"{where} lacks '{role_key}'/'{content_key}'")
        raw_role = str(turn[role_key]).strip().lower()
        role = ROLE_ALIASES.get(raw_role)
        if role is None:
            raise ChatError(f"{where} has unknown role {turn[role_key]!r}")
        message: dict = {"role": role}
        if isinstance(turn.get("name"), str) and turn["name"]:
            message["name"] = turn["name"]
        content = turn.get(content_key)
        if role == "assistant" and turn.get("tool_calls"):
            message["content"] = None if content is None else _text_content(content, where)
            message["tool_calls"] = _tool_calls(turn["tool_calls"], where)
        else:
            message["content"] = _text_content(content, where)
        if role == "tool":
            if not isinstance(turn.get("tool_call_id"), str):
                raise ChatError(f"{where} is a tool result without tool_call_id (the template names the call)")
            message["tool_call_id"] = turn["tool_call_id"]
        messages.append(message)
    if messages[0]["role"] == "system" and len(messages) == 1:
        raise ChatError("conversation holds only a system turn")
    if not any(m["role"] == "user" for m in messages):
        raise ChatError("conversation has no user turn")
    return messages


def normalize_tools(example: dict) -> list[dict] | None:
    """The row's ``tools`` declaration (OpenAI function tools), in the shape vLLM hands its template: ``{type,
    function: {name, description, parameters}}``; None when the row declares none."""
    tools = example.get("tools")
    if tools is None or tools == []:
        return None
    if isinstance(tools, str):  # some datasets store the list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ChatError(f"tools is a string that is not JSON ({e.msg})") from None
    if not isinstance(tools, list):
        raise ChatError(f"tools is {type(tools).__name__}, not a list")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatError(f"tool {j} is not an OpenAI function tool ({{type, function: {{name, ...}}}})")
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description"),
                                                     "parameters": fn.get("parameters")}})
    return out


def question_messages(messages: list[dict]) -> list[dict]:
    """The prompt stage 01b sends: the conversation cut after its last user or tool turn (where the assistant
    speaks next), tool calls and tool results before it included."""
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    return messages[: last + 1]


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, add_generation_prompt: bool,
           thinking: bool, tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, thinking=thinking
    )


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Tokenize rendered chat text exactly as vLLM's chat endpoint does (no extra BOS: the template holds it)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _before_first_turn(tokenizer, *, thinking: bool, tools) -> str:
    """What the template renders ahead of an assistant turn that opens the conversation: the tools declaration (if
    any) and the generation prompt. The template refuses an empty message list, so this is the difference of two
    renderings of a one-turn probe conversation."""
    probe = [{"role": "user", "content": "probe"}]
    turn = render(tokenizer, probe, add_generation_prompt=False, thinking=thinking)
    declared = render(tokenizer, probe, add_generation_prompt=False, thinking=thinking, tools=tools)
    prompted = render(tokenizer, probe, add_generation_prompt=True, thinking=thinking, tools=tools)
    if not declared.endswith(turn) or not prompted.startswith(declared):
        raise ChatError("chat template renders a one-turn conversation inconsistently; cannot place a first "
                        "assistant turn")
    return declared[: len(declared) - len(turn)] + prompted[len(declared):]


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, thinking: bool,
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, character spans of what each assistant turn generates).

    A turn's span is what the template renders after the generation prompt of the conversation before it, through
    the end of that turn (``</think>`` answer, tool calls, ``<|im_end|>`` after a thinking prompt): the text the
    model itself produces. Its role header belongs to the prompt, also for an assistant turn that opens the
    conversation.
    """
    full = render(tokenizer, messages, add_generation_prompt=False, thinking=thinking, tools=tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = (render(tokenizer, messages[:i], add_generation_prompt=True, thinking=thinking, tools=tools) if i
                  else _before_first_turn(tokenizer, thinking=thinking, tools=tools))
        upto = render(tokenizer, messages[: i + 1], add_generation_prompt=False, thinking=thinking, tools=tools)
        if not full.startswith(upto) or not upto.startswith(prefix):
            raise ChatError(f"chat template does not render turn {i} as a prefix of the whole conversation; "
                            "cannot locate the assistant span")
        spans.append((len(prefix), len(upto)))
    return full, spans


def tokenize_with_loss_mask(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, thinking: bool,
                            tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Render ``messages`` with the template; return (input_ids, loss_mask) with 1 on assistant-generated tokens.

    The rendered text is cut at every span boundary and each piece tokenized alone; the pieces' ids together must
    equal the whole text's ids, i.e. every token boundary falls on a span boundary (Kimi's special tokens around
    each turn make this hold). No character offsets are needed, so fast and slow (remote-code) tokenizers work
    alike. A row where a token straddles a boundary is refused with the turn named, never guessed.
    """
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError("conversation has no assistant turn to train on")
    full, spans = assistant_spans(tokenizer, messages, thinking=thinking, tools=tools)
    cuts = sorted({0, len(full), *(c for span in spans for c in span)})
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for a, b in zip(cuts, cuts[1:]):
        piece = encode(tokenizer, full[a:b])
        input_ids += piece
        loss_mask += [int(any(s <= a and b <= e for s, e in spans))] * len(piece)
    whole = encode(tokenizer, full)
    if whole != input_ids:
        at = next((t for t, (x, y) in enumerate(zip(whole, input_ids)) if x != y), min(len(whole), len(input_ids)))
        raise ChatError(f"token {at} crosses the boundary of an assistant turn (the tokenizer merges text across "
                        "turns), so the loss mask would be a guess")
    if not any(loss_mask):
        raise ChatError("no assistant token survived tokenization")
    return input_ids, loss_mask


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], *, thinking: bool,
                     tools: list[dict] | None = None) -> list[int]:
    """Prompt ids as the server builds them: the template with the generation prompt (ends with <think> if thinking)."""
    return encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True, thinking=thinking, tools=tools))


def rebuild_completion_ids(tokenizer: PreTrainedTokenizerBase, ids: SpecialIds, reasoning: str | None,
                           content: str | None, *, finished: bool, thinking: bool = True) -> list[int]:
    """Completion ids from text when a server returned none: reasoning + </think> + content + <|im_end|>.

    Thinking on, the prompt ends with <think>: the completion starts with the reasoning, and ``</think>`` follows
    unless the model was cut inside its reasoning (no content and not ``finished``); a finished turn with content
    None is an empty answer after ``</think>``. Thinking off, the prompt already ends with ``<think></think>``: the
    completion is the answer alone. ``finished`` (finish_reason "stop") appends the end-of-turn id.
    """
    if thinking:
        out = encode(tokenizer, reasoning) if reasoning else []
        if content is not None or finished:
            out = out + [ids.response] + (encode(tokenizer, content) if content else [])
    else:
        text = (reasoning or "") + (content or "")
        out = encode(tokenizer, text) if text else []
    if finished:
        out.append(ids.end_of_turn)
    return out
