"""Chat rendering, special ids and the assistant-only loss mask, proven on every supported dataset shape.

The reference for the mask is computed independently of chat.py's span logic: masked runs are decoded and compared
with the assistant turns' own text, and the unmasked remainder must hold every non-assistant turn and no answer.
"""

import json

import pytest

from eagle3pipe.chat import (
    ChatError,
    TokenIdMismatch,
    encode,
    load_tokenizer,
    normalize_messages,
    normalize_tools,
    prompt_token_ids,
    question_messages,
    rebuild_completion_ids,
    render,
    resolve_special_ids,
    tokenize_with_loss_mask,
)

# Real-format samples of each supported shape, with the awkward content real data has: leading/trailing whitespace,
# newlines, code, unicode, multi-turn with a system prompt, text that looks like template markup.
OPENAI_ROW = {
    "messages": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Write a Python function that adds two numbers."},
        {"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```\n"},
        {"role": "user", "content": " And in one line? "},
        {"role": "assistant", "content": "  add = lambda a, b: a + b"},
    ]
}
SHAREGPT_ROW = {
    "conversations": [
        {"from": "human", "value": "Übersetze: the cat sits — ça va? 数字 42"},
        {"from": "gpt", "value": "Die Katze sitzt.\n\nÇa va bien. 四十二"},
    ]
}
PERFECTBLEND_ROW = {  # open-perfectblend: conversations with from/value plus a source column
    "conversations": [
        {"from": "system", "value": "Answer with the number only."},
        {"from": "human", "value": "How many letters are in 'assistant'?"},
        {"from": "gpt", "value": "9"},
        {"from": "human", "value": "And in '<think>' written out?"},
        {"from": "gpt", "value": "7, the tag <think> has 7 characters."},
    ],
    "source": "mathinstruct",
}
ALL_ROWS = {"openai": OPENAI_ROW, "sharegpt": SHAREGPT_ROW, "perfectblend": PERFECTBLEND_ROW}


@pytest.fixture(scope="module")
def tok(toy_llama):
    return load_tokenizer(toy_llama)


def masked_runs(ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


@pytest.mark.parametrize("shape", sorted(ALL_ROWS))
@pytest.mark.parametrize("thinking", [True, False])
def test_loss_mask_covers_exactly_the_assistant_turns(tok, shape, thinking):
    messages = normalize_messages(ALL_ROWS[shape])
    ids, mask = tokenize_with_loss_mask(tok, messages, thinking=thinking)
    assert len(ids) == len(mask)
    # The tokens are exactly the template's rendering: decoding them gives the rendered text back.
    assert tok.decode(ids) == render(tok, messages, add_generation_prompt=False, thinking=thinking)

    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    runs = masked_runs(ids, mask)
    assert len(runs) == len(answers), "one supervised run per assistant turn"
    # What the model generates after its generation prompt: with thinking on the prompt ends at <think>, so the
    # (empty, for human data) reasoning closes with </think>; with thinking off the prompt already holds both.
    head = "</think>" if thinking else ""
    for run, answer in zip(runs, answers):
        assert tok.decode(run) == head + answer + "<|im_end|>"

    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked, "every user/system turn stays unsupervised"
    for answer in answers:
        assert answer.strip() not in unmasked, "no assistant text outside the mask"


def test_roles_normalised_and_questions_cut_at_last_user_turn():
    messages = normalize_messages(PERFECTBLEND_ROW)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    q = question_messages(messages)
    assert [m["role"] for m in q] == ["system", "user", "assistant", "user"]
    assert q[-1]["content"] == "And in '<think>' written out?"


@pytest.mark.parametrize(
    "row, fragment",
    [
        ({"text": "hello"}, "no 'messages' or 'conversations' column"),
        ({"messages": []}, "conversation is empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role 'wizard'"),
        ({"messages": [{"role": "user", "content": 5}]}, "content is int"),
        ({"conversations": [{"from": "gpt", "value": "hi"}]}, "no user turn"),
        ({"messages": [{"role": "user"}]}, "lacks 'role'/'content'"),
    ],
)
def test_malformed_rows_are_named(row, fragment):
    with pytest.raises(ChatError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        normalize_messages(row)


def test_special_ids_resolved_and_cross_checked(tok, toy_meta):
    ids = resolve_special_ids(tok, toy_meta["think_token_id"], toy_meta["response_token_id"])
    assert tok.convert_ids_to_tokens([ids.think, ids.response, ids.end_of_turn]) == ["<think>", "</think>", "<|im_end|>"]
    with pytest.raises(TokenIdMismatch, match=r"think_token_id = 163606 but the tokenizer maps '<think>' to"):
        resolve_special_ids(tok, 163606, toy_meta["response_token_id"])


def test_generation_prompt_ends_with_think_or_empty_think(tok, toy_meta):
    q = [{"role": "user", "content": "2+2?"}]
    on = prompt_token_ids(tok, q, thinking=True)
    off = prompt_token_ids(tok, q, thinking=False)
    assert on[-1] == toy_meta["think_token_id"]
    assert off[-2:] == [toy_meta["think_token_id"], toy_meta["response_token_id"]]


def test_rebuilt_completion_is_reasoning_response_content_end(tok, toy_meta):
    ids = resolve_special_ids(tok, toy_meta["think_token_id"], toy_meta["response_token_id"])
    q = [{"role": "user", "content": "2+2?"}]
    comp = rebuild_completion_ids(tok, ids, "two plus two is four", "4", finished=True)
    # Independent reference: the template renders a finished turn with this reasoning and content.
    full = render(tok, q + [{"role": "assistant", "content": "4", "reasoning": "two plus two is four"}],
                  add_generation_prompt=False, thinking=True)
    assert tok.decode(prompt_token_ids(tok, q, thinking=True) + comp) == full
    cut = rebuild_completion_ids(tok, ids, "two plus", None, finished=False)
    assert ids.response not in cut and ids.end_of_turn not in cut


def test_tokenizer_without_template_is_refused(tmp_path, toy_llama):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((toy_llama / name).read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatError, match="no chat_template"):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# The release-shaped tokenizer (tiktoken + remote code, slow: no offsets) and K2.5's template: tool use, thinking
# on/off, multi-turn, a conversation the assistant opens.

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# TOOLS as the release's tokenizer declares them (written by hand: `city` is optional, hence `city?`).
TOOLS_TS = ("# Tools\n\n## functions\nnamespace functions {\n// Weather by city\ntype get_weather = (_: {\n"
            "  city?: string\n}) => any;\n}\n")
TOOL_ROW = {
    "messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris and in 北京? getWeatherNow"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "functions.get_weather:1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "北京"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "12 C, rain"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "3 C"},
        {"role": "assistant", "content": "Paris: 12 C and rain. 北京: 3 C."},
    ],
    "tools": TOOLS,
}
ASSISTANT_FIRST_ROW = {"messages": [{"role": "assistant", "content": "Hi! How can I help?"},
                                    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
KIMI_ROWS = {**ALL_ROWS, "tools": TOOL_ROW, "assistant_first": ASSISTANT_FIRST_ROW}


@pytest.fixture(scope="module")
def ktok(toy_kimi):
    return load_tokenizer(toy_kimi, trust_remote_code=True)


def generated_text(message: dict, thinking: bool) -> str:
    """What the model generates for an assistant turn after K2.5's generation prompt, written out independently of
    the template: `</think>` (thinking prompt ends with `<think>`), the answer, the tool-call section, `<|im_end|>`."""
    out = "</think>" if thinking else ""
    out += message.get("content") or ""
    if message.get("tool_calls"):
        out += "<|tool_calls_section_begin|>"
        for call in message["tool_calls"]:
            args = call["function"]["arguments"]
            args = json.loads(args) if isinstance(args, str) else args
            out += (f"<|tool_call_begin|>{call['id']}<|tool_call_argument_begin|>{json.dumps(args, ensure_ascii=False)}"
                    "<|tool_call_end|>")
        out += "<|tool_calls_section_end|>"
    return out + "<|im_end|>"


@pytest.mark.parametrize("shape", sorted(KIMI_ROWS))
@pytest.mark.parametrize("thinking", [True, False])
def test_release_tokenizer_masks_cover_exactly_what_the_assistant_generates(ktok, shape, thinking):
    row = KIMI_ROWS[shape]
    messages, tools = normalize_messages(row), normalize_tools(row)
    ids, mask = tokenize_with_loss_mask(ktok, messages, thinking=thinking, tools=tools)
    assert ids == encode(ktok, render(ktok, messages, add_generation_prompt=False, thinking=thinking, tools=tools))
    turns = [m for m in messages if m["role"] == "assistant"]
    assert [ktok.decode(r) for r in masked_runs(ids, mask)] == [generated_text(m, thinking) for m in turns]
    unmasked = ktok.decode([i for i, m in zip(ids, mask) if not m])
    for m in messages:
        if m["role"] in ("user", "system", "tool"):
            assert m["content"] in unmasked
    assert unmasked.count("<|im_assistant|>assistant<|im_middle|>") == len(turns), "every role header unsupervised"
    if tools:  # declared TypeScript-style, as the release's tokenizer hands K2.5's template tools_ts_str
        assert unmasked.startswith("<|im_system|>tool_declare<|im_middle|>" + TOOLS_TS + "<|im_end|>")


def test_assistant_first_turn_header_is_not_supervised(ktok, tok):
    for t in (ktok, tok):
        messages = normalize_messages(ASSISTANT_FIRST_ROW)
        ids, mask = tokenize_with_loss_mask(t, messages, thinking=True)
        first = mask.index(1)
        assert t.decode(ids[:first]) == "<|im_assistant|>assistant<|im_middle|><think>"
        assert t.decode(masked_runs(ids, mask)[0]) == "</think>Hi! How can I help?<|im_end|>"


def _offset_mask(tok, messages, thinking):
    """The previous offset-based mask (fast tokenizers only), kept here as a reference for the segment method."""
    full = render(tok, messages, add_generation_prompt=False, thinking=thinking)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i:
            spans.append((len(render(tok, messages[:i], add_generation_prompt=True, thinking=thinking)),
                          len(render(tok, messages[: i + 1], add_generation_prompt=False, thinking=thinking))))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a and b <= e for s, e in spans) and b > a) for a, b in enc["offset_mapping"]]
    return enc["input_ids"], mask


@pytest.mark.parametrize("shape", sorted(ALL_ROWS))
@pytest.mark.parametrize("thinking", [True, False])
def test_segment_masks_equal_offset_masks_on_the_fast_toy(tok, shape, thinking):
    messages = normalize_messages(ALL_ROWS[shape])
    assert tokenize_with_loss_mask(tok, messages, thinking=thinking) == _offset_mask(tok, messages, thinking)


def test_token_across_a_turn_boundary_is_refused(tok):
    """A template with no markers between turns lets BPE merge across a boundary ("t" + "he" -> "the"): the row is
    refused, never given a guessed mask."""
    original = tok.chat_template
    messages = [{"role": "user", "content": "t"}, {"role": "assistant", "content": "he"}]
    try:
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        assert len(encode(tok, "the")) == 1  # one token spans both turns
        with pytest.raises(ChatError, match="crosses the boundary of an assistant turn"):
            tokenize_with_loss_mask(tok, messages, thinking=False)
    finally:
        tok.chat_template = original


def test_tool_rows_keep_calls_and_results_and_refuse_what_the_template_cannot_render():
    messages = normalize_messages(TOOL_ROW)
    assert messages[2]["content"] is None
    assert [c["function"]["arguments"] for c in messages[2]["tool_calls"]] == [{"city": "Paris"}, {"city": "北京"}]
    assert messages[3] == {"role": "tool", "name": "get_weather", "content": "12 C, rain",
                           "tool_call_id": "functions.get_weather:0"}
    assert question_messages(messages) == messages[:5]  # the assistant speaks next after the last tool result
    bad_args = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}
    with pytest.raises(ChatError, match="not valid JSON"):
        normalize_messages(bad_args)
    with pytest.raises(ChatError, match="without tool_call_id"):
        normalize_messages({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]})
    with pytest.raises(ChatError, match="text-only"):
        normalize_messages({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})


def test_rebuilt_completion_thinking_off_and_empty_answer(ktok, toy_kimi_meta):
    ids = resolve_special_ids(ktok, toy_kimi_meta["think_token_id"], toy_kimi_meta["response_token_id"])
    q = [{"role": "user", "content": "2+2?"}]
    # thinking off: the prompt already ends with <think></think>; no second </think>
    off = rebuild_completion_ids(ktok, ids, None, "4", finished=True, thinking=False)
    assert ids.response not in off
    assert ktok.decode(prompt_token_ids(ktok, q, thinking=False) + off) == render(
        ktok, q + [{"role": "assistant", "content": "4"}], add_generation_prompt=False, thinking=False)
    # a finished turn whose content came back None is an empty answer: </think> stays
    empty = rebuild_completion_ids(ktok, ids, "hmm", None, finished=True, thinking=True)
    assert ktok.decode(empty) == "hmm</think><|im_end|>"
    # cut inside the reasoning: no </think>
    assert ids.response not in rebuild_completion_ids(ktok, ids, "hmm", None, finished=False, thinking=True)


def test_any_tokenizer_load_failure_is_one_chat_error_naming_the_folder(toy_kimi, tmp_path):
    """A remote-code tokenizer can raise anything (a KeyError, a tiktoken parse error); the stage shows one line."""
    import shutil

    for name in ("tokenizer_config.json", "tokenization_kimi.py", "tool_declaration_ts.py", "chat_template.jinja"):
        shutil.copy(toy_kimi / name, tmp_path / name)
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(ChatError, match=f"the tokenizer at {tmp_path} failed to load: ") as e:
        load_tokenizer(tmp_path, trust_remote_code=True)
    assert "\n" not in str(e.value)
