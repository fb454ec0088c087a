"""Config loading: defaults, YAML, flags, precedence, and errors that name the culprit."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3pipe.config import ConfigError, load_config, parse_stage_args

ROOT = Path(__file__).resolve().parents[1]


def test_kimi_k25_yaml_holds_the_issue_defaults():
    cfg = load_config(ROOT / "configs/kimi_k25.yaml")
    s, g = cfg.shared, cfg.generate
    assert (s.think_token_id, s.response_token_id) == (163606, 163607)
    assert s.aux_layer_ids == [2, 30, 58]
    assert (s.hidden_size, s.vocab_size, s.draft_vocab_size, s.max_seq_len) == (7168, 163840, 32000, 32768)
    assert (g.concurrency, g.request_timeout_s, g.max_completion_tokens, g.max_samples, g.min_completion_tokens) == (
        128, 1800.0, 30720, 10000, 50)
    assert cfg.train.total_seq_len >= s.max_seq_len > g.max_completion_tokens  # long reasoning fits, uncut
    assert (g.temperature, g.top_p) == (1.0, 0.95)  # Moonshot's thinking-mode sampling (0.6 is instant mode)
    assert s.trust_remote_code is True and s.thinking is True  # the release's tokenizer is remote code
    assert cfg.extract.backend == "vllm"  # the int4 release does not fit transformers on one node


def test_kimi_k25_dflash_yaml_is_z_labs_k25_draft():
    """Issue 31: z-lab's published K2.5 DFlash draft (its config: 6 Qwen3 layers, 64 x 128 heads, 8 KV, MLP 18432,
    block 8, target_layer_ids [1, 12, 24, 35, 47, 58] in the "output of layer" convention, mask id 163838 = [UNK])."""
    cfg = load_config(ROOT / "configs/kimi_k25_dflash.yaml")
    t = cfg.train
    assert t.draft == "dflash" and cfg.draft_layer_ids == [k + 1 for k in [1, 12, 24, 35, 47, 58]]
    assert (t.dflash_num_layers, t.draft_num_heads, t.draft_head_dim, t.dflash_num_kv_heads,
            t.draft_intermediate_size, t.dflash_block_size) == (6, 64, 128, 8, 18432, 8)
    assert cfg.vocab.mask_token == "[UNK]" and (t.dflash_loss, t.dflash_position_weight) == ("ce", "dpace")


@pytest.mark.parametrize("train, shared, fragment", [
    ({"draft": "medusa"}, {}, "train.draft must be one of eagle3, eagle3_mla, dflash"),
    ({"draft": "eagle3_mla", "export_format": "speculators"}, {}, "speculators' format has no MLA layer"),
    ({"draft": "eagle3_mla"}, {"aux_layer_ids": [2, 13, 30, 58]}, "an EAGLE-3 draft reads 3 verifier states"),
    ({"anchor_to_init": -1e-4}, {}, "train.anchor_to_init must be a finite weight >= 0"),
    ({"max_samples": -1}, {}, r"train.max_samples must be >= 0 \(0 = the whole training split\), got -1"),
    ({}, {"aux_layer_ids": [2, 13, 30, 58]}, "an EAGLE-3 draft reads 3 verifier states"),
    ({"draft_layer_ids": [2, 31, 58]}, {"aux_layer_ids": [2, 13, 30, 58]}, "must be ascending ids among"),
    ({"draft": "dflash", "dflash_loss": "kl_div"}, {}, "dpace weighs slots by their cross-entropy"),
    ({"draft": "dflash", "dflash_block_size": 1}, {}, "dflash_block_size must be >= 2"),
    ({"draft": "dflash", "train_lm_head": True}, {"draft_vocab_size": 163840}, "lm_head out"),
    ({}, {"aux_layer_ids": [30, 2]}, "ascending distinct layer ids"),
    ({}, {"aux_layer_ids": [0, 30, 58]}, "layer id 0 .* cannot be captured"),
])
def test_draft_settings_are_checked_at_start(train, shared, fragment):
    cfg = load_config(None, {"train": train, "shared": {"max_seq_len": 1024, **shared}})
    with pytest.raises(ConfigError, match=fragment):
        cfg.validate("train")
    ok = load_config(None, {"train": {"draft_layer_ids": [2, 30, 58]},
                            "shared": {"max_seq_len": 1024, "aux_layer_ids": [2, 13, 30, 58]}})
    ok.validate("train")  # EAGLE-3 reading 3 of a union 02 captured


def test_user_chat_template_kwargs_merge_with_thinking():
    from eagle3pipe.generate_requests import Generator

    cfg = load_config(overrides={"shared": {"vllm_url": ["http://a:1"], "verifier": "v"},
                                 "generate": {"request_extra_json": '{"chat_template_kwargs": {"x": 1}, "top_k": 5}'}})
    cfg.validate("generate")
    body = Generator(cfg, None, None, {}, None, None, None, None).extra_body
    assert body["chat_template_kwargs"] == {"x": 1, "thinking": True} and body["top_k"] == 5
    cfg.generate.request_extra_json = '{"chat_template_kwargs": {"thinking": false}}'
    with pytest.raises(ConfigError, match="--thinking/--no-thinking"):
        cfg.validate("generate")


def test_kimi_k25_mla_yaml_is_lightseekorgs_mla_draft(tmp_path):
    """Issue 48: lightseekorg/kimi-k2.5-eagle3-mla's layer (K2.5's own MLA: 64 heads, q_lora 1536, kv_lora 512,
    nope / rope / v 128 / 64 / 128; dense MLP 18432), which the config leaves to the verifier's config.json; --plan's
    count of it, from K2.5's text_config (draft_mla.parameter_counts), checked against the arithmetic here."""
    import json

    from eagle3pipe.draft_mla import parameter_counts

    cfg = load_config(ROOT / "configs/kimi_k25_mla.yaml")
    t = cfg.train
    assert t.draft == "eagle3_mla" and cfg.draft_layer_ids == [2, 30, 58]
    assert (t.draft_num_heads, t.draft_intermediate_size, t.export_format) == (0, 0, "eagle3")  # the verifier's
    text = {"hidden_size": 7168, "num_attention_heads": 64, "intermediate_size": 18432, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    cfg.shared.verifier = str(tmp_path)
    h = 7168
    layer = (3 * h * h  # fc
             + 1536 * 2 * h + 1536 + 64 * 192 * 1536  # q_a, q_a_layernorm, q_b
             + 576 * 2 * h + 512 + 64 * 256 * 512 + h * 64 * 128  # kv_a, kv_a_layernorm, kv_b, o
             + 3 * 18432 * h + 4 * h)  # MLP; input, hidden, post-attention and final norms
    assert parameter_counts(cfg) == (layer + 32000 * h, layer)
    assert round(layer / 1e9, 3) == 0.667  # 0.67 B trained (the MHA K2.5 draft: 0.96 B)


@pytest.mark.parametrize("name", ["kimi_k25.yaml", "kimi_k25_dflash.yaml", "kimi_k25_mla.yaml", "demo.yaml"])
def test_shipped_configs_pass_the_start_checks_of_every_stage(name):
    cfg = load_config(ROOT / "configs" / name)
    cfg.evaluate.prompts = "p.jsonl"
    for stage in ("prepare", "extract", "vocab", "train", "evaluate"):
        cfg.validate(stage)


def test_rows_longer_than_training_uses_are_refused_at_start_naming_both_keys(tmp_path):
    """Issue 12 item 5: 01 would keep (and 02 extract) rows that training cuts at total_seq_len; refused at start."""
    y = tmp_path / "c.yaml"
    y.write_text("shared:\n  max_seq_len: 16384\n  data_dir: " + str(tmp_path / "data") + "\n"
                 "train:\n  total_seq_len: 8192\n")
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    for script, extra in (("01_prepare_data.py", ["--dataset", str(chats)]), ("02_extract_hidden_states.py", []),
                          ("04_train.py", [])):
        r = subprocess.run([sys.executable, script, "--config", str(y), "--verifier", str(tmp_path), *extra],
                           cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2, (script, r.stderr)
        assert "shared.max_seq_len 16384 exceeds train.total_seq_len 8192" in r.stderr, (script, r.stderr)
        assert "--max-seq-len" in r.stderr and "--total-seq-len" in r.stderr
    assert not (tmp_path / "data" / "prepared").exists()


def test_demo_yaml_loads():
    cfg = load_config(ROOT / "configs/demo.yaml")
    assert cfg.shared.data_dir == "data/demo"


def test_flag_beats_yaml_beats_default(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("shared:\n  data_dir: from_yaml\n  seed: 7\ngenerate:\n  concurrency: 4\n")
    cfg = parse_stage_args("generate", ["--config", str(y), "--concurrency", "9", "--vllm-url", "http://a:1",
                                        "--vllm-url", "http://b:2", "--verifier", "v"])
    assert cfg.shared.data_dir == "from_yaml" and cfg.shared.seed == 7  # YAML over default
    assert cfg.generate.concurrency == 9  # flag over YAML
    assert cfg.shared.vllm_url == ["http://a:1", "http://b:2"]  # repeatable flag
    assert cfg.generate.request_timeout_s == 1800.0  # default
    cfg = parse_stage_args("extract", ["--aux-layer-ids", "1", "3", "5", "--no-thinking", "--verifier", "v"])
    assert cfg.shared.aux_layer_ids == [1, 3, 5] and cfg.shared.thinking is False


@pytest.mark.parametrize(
    "yaml_text, fragment",
    [
        ("shared:\n  data_dri: x\n", "unknown key 'shared.data_dri'"),
        ("generat:\n  concurrency: 3\n", "unknown section 'generat'"),
        ("generate:\n  concurrency: many\n", "key 'generate.concurrency' must be an integer, got 'many'"),
        ("shared:\n  thinking: 1\n", "key 'shared.thinking' must be true or false"),
        ("shared:\n  aux_layer_ids: [2, x, 5]\n", "key 'shared.aux_layer_ids[1]' must be an integer"),
    ],
)
def test_bad_keys_and_types_are_named(tmp_path, yaml_text, fragment):
    y = tmp_path / "bad.yaml"
    y.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        load_config(y)
    assert fragment in str(e.value) and str(y) in str(e.value)


def test_bad_config_key_is_a_one_line_error_from_the_script(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("prepare:\n  max_sample: 3\n")
    r = subprocess.run([sys.executable, "01_prepare_data.py", "--config", str(y)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "unknown key 'prepare.max_sample'" in r.stderr


def test_validate_names_the_missing_flag():
    with pytest.raises(ConfigError, match="--vllm-url"):
        parse_stage_args("generate", ["--verifier", "v"])
    with pytest.raises(ConfigError, match="--dataset"):
        parse_stage_args("prepare", ["--verifier", "v"])


def test_online_training_flags_and_their_start_checks(tmp_path):
    """04 takes --data-source, --spool-gb and stage 02's --extract-url, --max-retries, --retry-backoff-s and
    --max-error-share (one setting each: extract.*); online refuses an empty or endless spool, a negative or endless
    cache (--cache-gb; offline it is refused) and a URL with /v1 before any work; a held-out split is taken online
    as offline (the default 0.05 passes)."""
    base = ["--data-dir", str(tmp_path), "--verifier", str(tmp_path), "--data-source", "online", "--eval-fraction",
            "0", "--total-seq-len", "256", "--max-seq-len", "256"]
    cfg = parse_stage_args("train", base + ["--spool-gb", "2.5", "--extract-url", "http://a:8000", "http://b:8000"])
    assert cfg.train.data_source == "online" and cfg.train.spool_gb == 2.5
    assert cfg.extract.extract_url == ["http://a:8000", "http://b:8000"]
    # the retries and the error share 04 online's stop message names (--max-error-share): stage 02's settings
    cfg = parse_stage_args("train", base + ["--max-retries", "9", "--retry-backoff-s", "1.5", "--max-error-share",
                                            "0.25"])
    assert (cfg.extract.max_retries, cfg.extract.retry_backoff_s, cfg.extract.max_error_share) == (9, 1.5, 0.25)
    with pytest.raises(SystemExit):  # only the borrowed flags: 02's other flags are not 04's
        parse_stage_args("train", base + ["--concurrency", "3"])
    assert parse_stage_args("train", base + ["--eval-fraction", "0.05", "--cache-gb", "3"]).train.cache_gb == 3.0
    for flags, fragment in ((["--spool-gb", "0"], "spool_gb"), (["--spool-gb", "inf"], "spool_gb"),
                            (["--cache-gb", "-1"], "train.cache_gb"), (["--cache-gb", "nan"], "train.cache_gb"),
                            (["--cache-gb", "inf"], "train.cache_gb"),
                            (["--data-source", "offline", "--cache-gb", "2"], "train.cache_gb 2: .* online only"),
                            (["--extract-url", "http://a:8000/v1"], "without /v1"),
                            (["--data-source", "stream"], "data_source")):
        with pytest.raises(ConfigError, match=fragment):
            parse_stage_args("train", base + flags)


# ---------------------------------------------------------------------------------------------------------------
# server_args: one type in every stage (issue 29), and the flags it may not hold (issue 26 items 7 and 8)

SERVER_ARGS_KEYS = {"generate": "generate.server_args", "extract": "extract.server_args",
                    "evaluate": "evaluate.server_args", "train": "extract.server_args"}  # 04 online starts 02's


def _server_args_of(cfg, key: str) -> list[str]:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _stage_flags(stage: str, tmp_path) -> list[str]:
    """The fewest flags that pass ``stage``'s start checks with a server started here."""
    return {"generate": ["--verifier", "v"], "extract": ["--verifier", "v", "--backend", "vllm"],
            "evaluate": ["--verifier", "v", "--prompts", "p.jsonl"],
            "train": ["--verifier", "v", "--data-source", "online", "--total-seq-len", "4096",
                      "--max-seq-len", "4096"]}[stage] + ["--data-dir", str(tmp_path)]


@pytest.mark.parametrize("stage", list(SERVER_ARGS_KEYS))
def test_server_args_is_a_list_from_one_cli_string_repeated_flags_or_yaml(stage, tmp_path):
    """One string on the command line is split as a shell would (a first word starting with -- included: argparse
    would take it for a flag), repeated flags add up, YAML takes a list (one word an item) or a string split the
    same way: the same argv for vLLM whichever way it was written."""
    key = SERVER_ARGS_KEYS[stage]
    want = ["--enforce-eager", "--max-model-len", "4096"]
    base = _stage_flags(stage, tmp_path)
    one = parse_stage_args(stage, base + ["--server-args", "--enforce-eager --max-model-len 4096"])
    assert _server_args_of(one, key) == want
    alone = parse_stage_args(stage, base + ["--server-args", "--enforce-eager"])
    assert _server_args_of(alone, key) == ["--enforce-eager"]
    repeated = parse_stage_args(stage, base + ["--server-args", "--enforce-eager",
                                               "--server-args=--max-model-len 4096"])
    assert _server_args_of(repeated, key) == want
    quoted = parse_stage_args(stage, base + ["--server-args", """--override-generation-config '{"a": 1}'"""])
    assert _server_args_of(quoted, key) == ["--override-generation-config", '{"a": 1}']
    section = key.split(".")[0]
    for value in (want, "--enforce-eager --max-model-len 4096"):
        y = tmp_path / "c.yaml"
        y.write_text(yaml.safe_dump({section: {"server_args": value}}))
        assert _server_args_of(parse_stage_args(stage, base + ["--config", str(y)]), key) == want
    assert parse_stage_args(stage, base + ["--config", str(y), "--server-args", "--dtype half"]) \
        .to_dict()[section]["server_args"] == ["--dtype", "half"]  # the flag replaces the YAML's list


def test_a_server_args_item_holding_a_flag_and_its_value_is_refused_naming_the_split(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump({"evaluate": {"server_args": ["--enforce-eager", "--max-model-len 4096"]}}))
    with pytest.raises(ConfigError, match=r"evaluate.server_args\[1\] '--max-model-len 4096'.*'--max-model-len', "
                                          r"'4096'"):
        load_config(y)


@pytest.mark.parametrize("flag", ["--host 0.0.0.0", "--host=0.0.0.0", "--hos 0.0.0.0", "--port 8000",
                                  "--port=8000"])
@pytest.mark.parametrize("stage", list(SERVER_ARGS_KEYS))
def test_host_and_port_in_server_args_are_refused_naming_the_flag_to_use(stage, flag, tmp_path):
    """Issue 26 item 7: vLLM keeps the last --host (and takes any unambiguous abbreviation, as argparse does), so
    server_args could make a server started here (02's writes files where a request says) listen on every address.
    Refused at start, in YAML and on the command line, naming the URL flag of a server started by hand."""
    key = SERVER_ARGS_KEYS[stage]
    url_flag = {"generate": "--vllm-url", "extract": "--extract-url", "evaluate": "--eval-url",
                "train": "--extract-url"}[stage]
    with pytest.raises(ConfigError, match=rf"{key}: {flag.split()[0].split('=')[0]} .*127\.0\.0\.1.*{url_flag}"):
        parse_stage_args(stage, _stage_flags(stage, tmp_path) + ["--server-args", flag])
    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump({key.split(".")[0]: {"server_args": ["--tensor-parallel-size", "8", *flag.split()]}}))
    with pytest.raises(ConfigError, match=rf"{key}: .*{url_flag}"):
        load_config(y)


@pytest.mark.parametrize("flag", ["--api-key s3cret", "--api-key=s3cret", "--api_key s3cret", "--hf-token s3cret"])
def test_a_secret_in_server_args_is_refused_pointing_to_the_environment(flag, tmp_path):
    """Issue 26 item 8: server_args is logged, saved in provenance.json and report.json's config: a key there is
    refused (the message does not repeat it) and $VLLM_API_KEY named, which servers started here require."""
    for stage, key in SERVER_ARGS_KEYS.items():
        with pytest.raises(ConfigError) as e:
            parse_stage_args(stage, _stage_flags(stage, tmp_path) + ["--server-args", f"--enforce-eager {flag}"])
        assert key in str(e.value) and "s3cret" not in str(e.value)
        assert ("$VLLM_API_KEY" if "api" in flag else "$HF_TOKEN") in str(e.value)


def test_the_refusal_is_a_one_line_error_from_the_scripts(tmp_path):
    """Through the doors (01b's own flag, 04's borrowed from 02); every stage's parse is covered in-process above."""
    for script, extra in (("01b_generate_synthetic.py", []), ("04_train.py", ["--data-source", "online"])):
        r = subprocess.run([sys.executable, script, "--data-dir", str(tmp_path), "--verifier", "v", *extra,
                            "--server-args", "--host 0.0.0.0 --api-key s3cret"], cwd=ROOT, capture_output=True,
                           text=True)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, (script, r.stderr)
        assert "--host" in r.stderr and "s3cret" not in r.stderr, (script, r.stderr)
        assert not (tmp_path / "logs").exists()  # refused before the stage's log was opened


# ---------------------------------------------------------------------------------------------------------------
# --help from the config's field comments (issue 29)

STAGES = ["prepare", "generate", "extract", "vocab", "train", "evaluate"]


def test_every_config_field_has_a_description_from_its_comment():
    import dataclasses

    from eagle3pipe.config import SECTIONS, field_docs

    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        assert set(docs) == {f.name for f in dataclasses.fields(cls)}, section
        for name, text in docs.items():
            assert text.strip() and not text.startswith("#"), f"{section}.{name}: {text!r}"
    docs = field_docs(SECTIONS["shared"])
    # one line and its continuation lines, joined; read from the source, independently of the function
    assert docs["hidden_size"] == "verifier hidden size; cross-checked against the verifier config"
    assert docs["max_seq_len"].startswith("tokens per sample, prompt + completion;")
    assert docs["max_seq_len"].endswith("(a 32768-token row = 1.9 GB; fp8 half)")


@pytest.mark.parametrize("stage", STAGES)
def test_every_flag_of_every_stage_shows_its_description_and_default(stage):
    import argparse
    import dataclasses

    from eagle3pipe.config import SECTIONS, build_parser, field_docs

    parser = build_parser(stage, None)
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(flags) > 5
    for action in flags:
        assert action.help and action.help.strip(), action.option_strings
        if action.dest == "config":
            continue
        section, name = action.dest.split(".")
        default = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
        value = default.default_factory() if default.default_factory is not dataclasses.MISSING else default.default
        assert field_docs(SECTIONS[section])[name].replace("%", "%%") in action.help, action.dest
        assert "(default: " in action.help, action.dest
        shown = action.help.rsplit("(default: ", 1)[1].rstrip(")")
        if isinstance(value, bool):
            assert shown == str(value).lower(), action.dest
        elif isinstance(value, list):
            assert shown == (" ".join(map(str, value)) or "none"), action.dest
        elif isinstance(value, str):
            assert shown == (value or "empty"), action.dest
        else:
            assert float(shown) == value, action.dest


def test_each_script_help_prints_descriptions_and_defaults(monkeypatch):
    """What a user reads: every stage's --help as its door builds it (argparse wraps lines: compared without line
    breaks), and one door run for real (`python 01b_generate_synthetic.py --help`)."""
    import re

    from eagle3pipe.config import build_parser

    monkeypatch.setenv("COLUMNS", "100")
    expect = {"prepare": ("--max-samples", "questions kept per dataset", "(default: 10000)"),
              "generate": ("--concurrency", "requests in flight at once, over all servers", "(default: 128)"),
              "extract": ("--storage-dtype", "one scale per token and state", "(default: bf16)"),
              "vocab": ("--rebuild", "rebuild the map from our data", "(default: false)"),
              "train": ("--learning-rate", "peak AdamW learning rate", "(default: 0.0001)"),
              "evaluate": ("--concurrency", "requests in flight; each level is one pass", "(default: 8)")}
    for stage, words in expect.items():
        text = re.sub(r"\s+", " ", build_parser(stage, "Stage NN: a door's docstring.").format_help())
        for w in words + ("Stage NN: a door's docstring.", "--aux-layer-ids", "(default: 2 30 58)"):
            assert w in text, (stage, w)
    r = subprocess.run([sys.executable, "01b_generate_synthetic.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    text = re.sub(r"\s+", " ", r.stdout)
    assert "Stage 01b: regenerate every answer" in text and "(default: 128)" in text
    assert "--server-args 'FLAGS' no --vllm-url: start the verifier's server here with these vLLM flags" in text
