"""Chat rendering, special ids and the assistant-only loss mask, proven on every supported dataset shape.

The reference for the mask is computed independently of chat.py's span logic: masked runs are decoded and compared
with the assistant turns' own text, and the unmasked remainder must hold every non-assistant turn and no answer.
"""

import json

import pytest

from eagle3pipe.chat import (
    ChatError,
    TokenIdMismatch,
    load_tokenizer,
    normalize_messages,
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
