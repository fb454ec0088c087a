"""vLLM 0.34.0 (issue 49), the release users install today, built on CPU with its own classes: hand-run.

Marked ``vllm034`` and deselected unless ``$EAGLE3PIPE_VLLM034_PYTHON`` names an interpreter with vLLM 0.34.0 (its
GPU wheel with a CPU torch: docs/development.md "vLLM 0.34 by hand" says how to make one; it is several GB, too
large for CI). The summary then says they did not run. What runs is ours built here (the commands our launcher, 05
and the printed recipe give, the request bodies 01b, 02 and 05 send, drafts of each family exported by 04's code)
and vLLM 0.34's own code making of it what a server would (tests/vllm034_probe.py): its CLI parser, engine arguments,
model and speculative configs (the per-method registry, which forbids unknown keys), its check of the server's
environment, its request models, stage 02's connector through vLLM's scheduler and worker calls on a hidden-state
cache vLLM plans, lays out, allocates and fills itself, and its Prometheus and per-request counters. No server
starts and no GPU runs: whether 0.34's Model Runner V2 runs our stages on a GPU is the device's to prove.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3pipe.config import load_config
from eagle3pipe.server import VllmServer, free_port

pytestmark = pytest.mark.vllm034

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "vllm034_probe.py"
VLLM034_ENV = "EAGLE3PIPE_VLLM034_PYTHON"
CI_VERIFIER = REPO / "data" / "ci" / "verifier"
DRAFT_VOCAB = 512
DFLASH_MASK_ID = 5
SPEC_STEPS = [[3, 3], [3, 1], [3, 0], [3, 2], [3, 3]]  # (drafted, accepted) per verify step, k = 3


def vllm034_python() -> str:
    python = os.environ.get(VLLM034_ENV, "")
    if not Path(python).is_file():
        pytest.fail(f"${VLLM034_ENV} ({python!r}) is not an interpreter with vLLM 0.34.0 (docs/development.md)")
    return python


def toy_meta(verifier: Path) -> dict:
    return json.loads((verifier / "toy_verifier.json").read_text())


def toy_config(verifier: Path, data_dir: Path, **sections) -> object:
    meta = toy_meta(verifier)
    cfg = {"shared": {"verifier": str(verifier), "data_dir": str(data_dir), "hidden_size": meta["hidden_size"],
                      "vocab_size": meta["vocab_size"], "draft_vocab_size": DRAFT_VOCAB,
                      "aux_layer_ids": meta["aux_layer_ids"], "think_token_id": meta["think_token_id"],
                      "response_token_id": meta["response_token_id"], "max_seq_len": 1024},
           "train": {"device": "cpu", "dflash_num_kv_heads": 0}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return load_config(None, cfg)


def export_draft(family: str, verifier: Path, out: Path) -> Path:
    """A draft of ``family`` exported by 04's own code (train_drafts: new_model, then export), random weights."""
    from eagle3pipe.train_drafts import FAMILIES

    cfg = toy_config(verifier, out.parent / "data", train={"draft": family})
    meta = toy_meta(verifier)
    d2t = torch.zeros(DRAFT_VOCAB, dtype=torch.int64)  # the first DRAFT_VOCAB ids
    t2d = torch.arange(meta["vocab_size"]) < DRAFT_VOCAB
    torch.manual_seed(0)
    extra = (DFLASH_MASK_ID,) if family == "dflash" else ()
    model, _ = FAMILIES[family](cfg, torch.device("cpu")).new_model(d2t, t2d, "sdpa", *extra)
    return FAMILIES[family](cfg, torch.device("cpu")).export(model, out, None)


def run_probe(phase: str, inp: dict, work: Path, env: dict[str, str]) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "in.json").write_text(json.dumps(inp))
    res = subprocess.run([vllm034_python(), str(PROBE), phase, str(work / "in.json"), str(work / "out.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=1500,
                         env={**os.environ, "PYTHONPATH": str(REPO), "VLLM_NO_USAGE_STATS": "1",
                              "HF_HUB_OFFLINE": "1", **env})
    out = json.loads((work / "out.json").read_text()) if (work / "out.json").is_file() else {}
    assert res.returncode == 0 and "error" not in out, out.get("error") or res.stderr[-4000:]
    assert out["vllm"] == "0.34.0"
    out["log"] = res.stdout + res.stderr  # vLLM's log lines, ours among them
    return out


def command_args(server: VllmServer) -> list[str]:
    """What vLLM's api_server module is given of our launcher's command (after ``python -m MODULE``)."""
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    return cmd[3:]


def printed_serve(line: str) -> list[str]:
    """``... -m vllm.entrypoints.cli.main serve MODEL ...`` (a printed command) as ``serve MODEL ...``."""
    words = shlex.split(line)
    return words[words.index("serve"):]


def page_serve_commands() -> list[tuple[str, list[str]]]:
    """Every ``vllm serve /models/...`` command a page shows, continuation lines joined."""
    out = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for n, line in enumerate(page.read_text().replace("\\\n", " ").splitlines()):
            m = re.match(r"^\s*(?:\w+=\S+\s+)*vllm serve (/models/\S+.*)$", line)
            if m:
                out.append((f"{page.relative_to(REPO)}:{n + 1}", ["serve", *shlex.split(m.group(1))]))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory, toy_deepseek) -> dict:
    """What our code gives vLLM 0.34, built in this environment: drafts of each family, server commands, bodies."""
    from eagle3pipe import extract_vllm, recipe
    from eagle3pipe.evaluate import PER_REQUEST_FLAG, chat_request, draft_serving, speculative_config
    from eagle3pipe.generate_requests import Generator
    from eagle3pipe.records import Question

    root = tmp_path_factory.mktemp("vllm034")
    drafts = {"eagle3": export_draft("eagle3", CI_VERIFIER, root / "eagle3"),
              "eagle3_mla": export_draft("eagle3_mla", toy_deepseek, root / "eagle3_mla"),
              "dflash": export_draft("dflash", CI_VERIFIER, root / "dflash")}
    verifier_of = {"eagle3": CI_VERIFIER, "eagle3_mla": toy_deepseek, "dflash": CI_VERIFIER}
    python = vllm034_python()
    cfg = toy_config(CI_VERIFIER, root / "data", generate={"server_args": [
        "--reasoning-parser", "kimi_k2", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
        "--max-model-len", "1024"]})
    num_layers = toy_meta(CI_VERIFIER)["num_layers"]
    storage = root / "data" / "hidden_states" / "work"
    commands = {"01b": command_args(VllmServer(CI_VERIFIER, extra_args=cfg.generate.server_args, python=python,
                                               enforce_eager=False, kv_cache_gib=None))}
    x_args = extract_vllm.server_args(cfg, storage, num_layers, 1025, cpu=False)
    commands["02"] = command_args(VllmServer(CI_VERIFIER, extra_args=x_args, python=python, enforce_eager=False,
                                             kv_cache_gib=None))
    envs = {}
    for family, folder in drafts.items():  # 05's servers on a GPU build, as run_evaluate starts them
        draft_config = json.loads((folder / "config.json").read_text())
        backend, env = draft_serving(toy_config(verifier_of[family], root / "data"), draft_config, "gpu", "0.34.0")
        spec = ["--speculative-config", speculative_config(folder.resolve(), 3, backend), PER_REQUEST_FLAG, "summary"]
        commands[f"05 {family}"] = command_args(VllmServer(verifier_of[family], extra_args=spec, python=python,
                                                           served_model_name="verifier", enforce_eager=False,
                                                           kv_cache_gib=None, tensor_parallel_size=1))
        envs[f"05 {family}"] = env
    flex = ["--speculative-config", speculative_config(drafts["eagle3"].resolve(), 3, "FLEX_ATTENTION")]
    commands["05 eagle3, its own attention backend"] = command_args(VllmServer(CI_VERIFIER, extra_args=flex,
                                                                               python=python, kv_cache_gib=None))
    config_path = root / "cfg.yaml"
    config_path.write_text(json.dumps({"shared": {k: getattr(cfg.shared, k) for k in (
        "verifier", "data_dir", "hidden_size", "vocab_size", "draft_vocab_size", "aux_layer_ids", "think_token_id",
        "response_token_id", "max_seq_len")} | {"verifier": str(CI_VERIFIER)},
        "generate": {"server_args": cfg.generate.server_args}}))
    printed = [ln for ln in recipe.two_node(str(config_path), ("node0", "node1")).splitlines()
               if " serve " in ln and not ln.startswith("#")]
    commands["recipe 01b"], commands["recipe 02"] = printed_serve(printed[0]), printed_serve(printed[1])

    question = Question("q1", [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], "test", tools=[
        {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"]}}}])
    gen = Generator(cfg, None, None, {}, None, None, None, None, urls=["http://127.0.0.1:8000"])
    chat = chat_request("verifier", {"messages": [{"role": "user", "content": "2+2?"}]}, cfg)
    body_05 = {k: v for k, v in chat.items() if k != "extra_body"} | chat["extra_body"]
    ids = list(range(20, 20 + 70))
    requests = {"01b": ["chat", gen.request_body("verifier", question)],
                "02": ["completion", extract_vllm.request_body(
                    "verifier", ids, storage / "shard_0" / "hs_0.safetensors", "fp8", False)],
                "02 capture check": ["completion", extract_vllm.request_body(
                    "verifier", ids, storage / "shard_0" / "hs_1.safetensors", "bf16", True)],
                "05": ["chat", body_05]}
    environ = {**envs, "01b, 02 (launcher)": {"VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1"},
               "vLLM < 0.29 workaround (05 never sends it to 0.34)": {"VLLM_USE_V2_MODEL_RUNNER": "0"}}
    return {"root": root, "cfg": cfg, "drafts": drafts, "storage": storage, "num_layers": num_layers, "ids": ids,
            "x_args": x_args, "commands": commands, "requests": requests, "environ": environ,
            "pages": page_serve_commands()}


@pytest.fixture(scope="module")
def cli(built) -> dict:
    inp = {"commands": built["commands"], "pages": built["pages"], "environ": built["environ"],
           "requests": built["requests"], "spec_steps": SPEC_STEPS, "spec_k": 3}
    return run_probe("cli", inp, built["root"] / "cli", {"VLLM_TARGET_DEVICE": "cpu"})


def _connector_run(built, name: str, verifier: Path, layouts, sliding_window: int | None) -> dict:
    """One pass of the connector on ``verifier``: 02's flags for a storage folder of its own, 02's request bodies."""
    from eagle3pipe import extract_vllm

    storage = built["root"] / "engine_store" / name
    storage.mkdir(parents=True)
    cfg = toy_config(verifier, built["root"] / "data")
    args = extract_vllm.server_args(cfg, storage, toy_meta(verifier)["num_layers"], 1025, cpu=False)
    reqs = []
    for i, (length, dtype) in enumerate(((70, "bf16"), (130, "fp8"), (9, "bf16"))):
        body = extract_vllm.request_body("verifier", list(range(30 + i, 30 + i + length)),
                                         storage / f"shard_{i}" / f"hs_{i}.safetensors", dtype, False)
        reqs.append({"id": f"ok-{i}", "body": body, "scheduled": True})
    outside = extract_vllm.request_body("verifier", list(range(40, 60)), built["root"] / "outside.safetensors",
                                        "bf16", False)
    reqs.append({"id": "outside", "body": outside, "scheduled": True})
    never = extract_vllm.request_body("verifier", list(range(40, 50)), storage / "never.safetensors", "bf16", False)
    reqs.append({"id": "never-scheduled", "body": never, "scheduled": False})
    return {"verifier": str(verifier), "layouts": layouts, "sliding_window": sliding_window, "requests": reqs,
            "max_model_len": 1025,
            "dtype": args[args.index("--dtype") + 1], "trust_remote_code": cfg.shared.trust_remote_code,
            "speculative_config": args[args.index("--speculative-config") + 1],
            "kv_transfer_config": args[args.index("--kv-transfer-config") + 1], "cache_bytes": 64 << 20}


# the connector's passes: a Llama verifier on a worker whose attention backends declare no layout (our connector's
# "LBNHC" is taken) and on one that allows only "LBHNC" (vLLM drops the connector's choice, with a warning); an MLA
# + MoE verifier (DeepseekV3, K2.5's architecture); the Llama with every other layer windowed (a hybrid verifier:
# vLLM gives the hidden states a group of their own, a block size fitted to the verifier's page, the page padded)
CONNECTOR_RUNS = {"llama": ("llama", "default", None), "llama_LBHNC_only": ("llama", ["LBHNC"], None),
                  "deepseek_mla": ("deepseek", "default", None), "llama_hybrid": ("llama", "default", 32)}


@pytest.fixture(scope="module")
def engine(built, toy_deepseek) -> dict:
    from eagle3pipe.evaluate import speculative_config

    verifiers = {"llama": CI_VERIFIER, "deepseek": toy_deepseek}
    inp = {"verifier": str(CI_VERIFIER), "port": free_port(),
           "connector_runs": {name: _connector_run(built, name, verifiers[v], layouts, window)
                              for name, (v, layouts, window) in CONNECTOR_RUNS.items()},
           "metrics": {"speculative_config": speculative_config(built["drafts"]["eagle3"].resolve(), 3),
                       "max_model_len": 1024, "steps": SPEC_STEPS, "generation_tokens": 17,
                       "inter_token_latencies": [0.02, 0.03, 0.025, 0.04, 0.02], "tpot": [0.011, 0.013]}}
    out = run_probe("engine", inp, built["root"] / "engine", {})
    out["input"] = inp
    out["dir"] = built["root"] / "engine"
    return out


# ---------------------------------------------------------------------------------------------------------------
# The commands


def test_the_stages_probe_and_check_read_0_34(tmp_path, monkeypatch):
    """What the stages ask a vLLM interpreter before starting a server (server.probe_vllm: platform, version, the
    per-request counters flag read in its arg_utils.py) and what --check reads of it (its package metadata)."""
    from eagle3pipe.doctor import check_vllm, probe_vllm_version
    from eagle3pipe.server import probe_vllm
    from eagle3pipe.vllm_internals import READ_ONLY

    python = vllm034_python()
    assert probe_vllm_version(python) == {"dist": "vllm", "version": "0.34.0"}
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # no GPU here: vLLM's platform would be none
    env = probe_vllm(python)
    assert (env.version, env.platform, env.per_request_spec_metrics) == ("0.34.0", "cpu", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    cfg = toy_config(CI_VERIFIER, tmp_path / "data", extract={"backend": "vllm"})
    check = check_vllm(cfg, python, gpus_visible=0)
    assert check.status == "warn" and f"vllm 0.34.0 at {python}: {READ_ONLY}" in check.message, check.line()


def test_02s_command_builds_the_extraction_method_with_our_connector_and_its_settings(cli, built):
    from eagle3pipe.extract_vllm import CONNECTOR_CLASS, CONNECTOR_MODULE, GPU_MEMORY_UTILIZATION, layer_ids

    got = cli["commands"]["02"]
    want_ids = layer_ids(built["cfg"].shared.aux_layer_ids, built["num_layers"])
    assert got["speculative"] == {
        "method": "extract_hidden_states", "speculator_config": "ExtractHiddenStatesSpeculatorConfig",
        "num_speculative_tokens": 1, "draft_architectures": ["ExtractHiddenStatesModel"],
        "draft_model": str(CI_VERIFIER), "attention_backend": None, "aux_layer_ids": want_ids,
        "uses_aux_hidden_states": True}
    kv = got["kv_transfer_config"]
    assert (kv["kv_connector"], kv["kv_connector_module_path"], kv["kv_role"]) == (CONNECTOR_CLASS, CONNECTOR_MODULE,
                                                                                   "kv_producer")
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": str(built["storage"].resolve()),
                                               "storage_dtype": built["cfg"].extract.storage_dtype}
    assert got["enable_prefix_caching"] is False and got["max_model_len"] == 1025
    assert got["gpu_memory_utilization"] == float(GPU_MEMORY_UTILIZATION)  # 0.34 would otherwise take all it sees
    assert got["unknown_spec_keys"] == [] and got["dtype"] == built["cfg"].extract.model_dtype
    # the command the recipe prints for the servers users start is read the same way
    printed = cli["commands"]["recipe 02"]
    assert printed["speculative"] == got["speculative"] and printed["kv_transfer_config"] == kv


def test_05s_commands_build_each_draft_family_on_the_per_method_registry(cli, built):
    """0.34's speculative config is a registry of per-method configs that forbids unknown keys: each family 04
    exports is read as the method 05 names, at its own k, with per-request counters on; the draft's own attention
    backend (evaluate.draft_attention_backend) is a key it still takes."""
    from eagle3pipe.draft_dflash import speculative_tokens

    want = {"eagle3": ("eagle3", "Eagle3SpeculatorConfig", ["LlamaForCausalLMEagle3"], 3),
            "eagle3_mla": ("eagle3", "Eagle3SpeculatorConfig", ["Eagle3DeepseekV2ForCausalLM"], 3),
            "dflash": ("dflash", "DFlashSpeculatorConfig", None,
                       speculative_tokens(json.loads((built["drafts"]["dflash"] / "config.json").read_text())))}
    for family, (method, speculator, archs, k) in want.items():
        got = cli["commands"][f"05 {family}"]
        spec = got["speculative"]
        assert (spec["method"], spec["speculator_config"], spec["num_speculative_tokens"]) == (method, speculator, k)
        assert archs is None or spec["draft_architectures"] == archs, spec
        assert spec["draft_model"] == str(built["drafts"][family].resolve()) and spec["uses_aux_hidden_states"]
        assert spec["attention_backend"] is None and got["unknown_spec_keys"] == []
        assert got["per_request_spec_decode_metrics"] == "summary" and got["served_model_name"] == ["verifier"]
    flex = cli["commands"]["05 eagle3, its own attention backend"]
    assert flex["speculative"]["attention_backend"] == "FLEX_ATTENTION" and flex["unknown_spec_keys"] == []


def test_01b_s_commands_parse_and_the_pages_serve_commands_hold_no_key_0_34_refuses(cli, built):
    for name in ("01b", "recipe 01b"):
        got = cli["commands"][name]
        assert got["reasoning_parser"] == "kimi_k2" and "speculative" not in got, got
        assert got["architectures"] == ["LlamaForCausalLM"] and got["max_model_len"] == 1024
    assert built["pages"], "no page shows a vllm serve command"
    for where, got in cli["pages"].items():
        assert "error" not in got and got["unknown_spec_keys"] == [], (where, got)
        assert got["tensor_parallel_size"] == 8 and got["trust_remote_code"], (where, got)


def test_the_servers_environment_passes_0_34s_check_and_the_v1_runner_variable_would_not(cli):
    """vLLM 0.34 refuses to start with VLLM_USE_V2_MODEL_RUNNER=0 (05's vLLM < 0.29 workaround): 05 gives its
    servers none of it on 0.34 (evaluate.v1_runner_env), and every environment it and the launcher set passes."""
    for name, result in cli["environ"].items():
        if name.startswith("vLLM < 0.29"):
            assert result.startswith("ValueError: VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported"), result
        else:
            assert result == "ok", (name, result)


# ---------------------------------------------------------------------------------------------------------------
# The requests and the counters


def test_01b_02_and_05_request_bodies_are_read_whole_by_0_34s_request_models(cli, built):
    reqs = cli["requests"]
    for name, got in reqs.items():
        assert got["unknown_fields"] == [], (name, got)  # vLLM would drop (and only log) a field it does not know
    s = reqs["01b"]["sampling"]
    assert s["spaces_between_special_tokens"] is False and reqs["01b"]["return_token_ids"] is True
    assert reqs["01b"]["chat_template_kwargs"] == {"thinking": built["cfg"].shared.thinking}
    assert s["max_tokens"] == built["cfg"].generate.max_completion_tokens
    for name, dtype, logprobs in (("02", "fp8", None), ("02 capture check", "bf16", 5)):
        s = reqs[name]["sampling"]
        path = built["requests"][name][1]["kv_transfer_params"]["hidden_states_path"]
        assert s["extra_args"]["kv_transfer_params"] == {"hidden_states_path": path, "storage_dtype": dtype}
        assert (s["max_tokens"], s["temperature"], s["prompt_logprobs"]) == (1, 0.0, logprobs)
    s = reqs["05"]["sampling"]
    assert reqs["05"]["chat_template_kwargs"] == {"thinking": built["cfg"].shared.thinking}
    assert (s["seed"], s["max_tokens"]) == (built["cfg"].shared.seed, built["cfg"].evaluate.max_completion_tokens)


def test_05_reads_0_34s_per_request_counters_as_vllm_counts_them(cli):
    from eagle3pipe.acceptance import per_request_delta

    spec = cli["spec_metrics"]["speculative_decoding"]
    figures = per_request_delta([spec])
    accepted = sum(a for _, a in SPEC_STEPS)
    assert figures["drafts"] == len(SPEC_STEPS) and figures["accepted_tokens"] == accepted
    assert figures["draft_tokens"] == sum(d for d, _ in SPEC_STEPS)
    assert figures["acceptance_length"] == pytest.approx(spec["mean_acceptance_length"], abs=1e-4)
    assert figures["accepted_per_position"] == [sum(a > i for _, a in SPEC_STEPS) for i in range(3)]


def test_05_and_01b_read_0_34s_prometheus_counters_and_decode_timings(engine):
    from eagle3pipe.vllm_client import ServerMetrics, acceptance_length, parse_prometheus_text

    m = engine["input"]["metrics"]
    got = ServerMetrics(url="", taken_at=0.0, samples=parse_prometheus_text(engine["metrics_text"]))
    accepted = sum(a for _, a in SPEC_STEPS)
    assert (got.spec_decode_drafts, got.spec_decode_accepted_tokens) == (len(SPEC_STEPS), accepted)
    assert got.spec_decode_draft_tokens == sum(d for d, _ in SPEC_STEPS)
    assert got.spec_decode_accepted_per_position() == [sum(a > i for _, a in SPEC_STEPS) for i in range(3)]
    assert acceptance_length(ServerMetrics("", 0.0), got) == pytest.approx(1 + accepted / len(SPEC_STEPS))
    assert got.step_latency_count == len(m["inter_token_latencies"])
    assert got.step_latency_sum_s == pytest.approx(sum(m["inter_token_latencies"]))
    assert (got.tpot_count, got.tpot_sum_s) == (len(m["tpot"]), pytest.approx(sum(m["tpot"])))
    assert got.generation_tokens == m["generation_tokens"]
    assert got.has("vllm:num_requests_running") and got.has("vllm:num_requests_waiting")


# ---------------------------------------------------------------------------------------------------------------
# Stage 02's connector


@pytest.mark.parametrize("run", list(CONNECTOR_RUNS))
def test_our_connector_writes_what_0_34s_cache_holds_whichever_layout_vllm_picks(engine, run):
    """02's flags build the VllmConfig; vLLM plans the hidden-state cache beside the verifier's own attention caches,
    lays it out as it resolves, allocates it, and its own writer fills it; our connector, driven by the calls vLLM's
    scheduler and worker make, writes each request's file: the states vLLM cached for its tokens (blocks out of
    order), its token ids, in the dtype the request asked for, passing stage 02's own check; a path outside the
    storage folder is refused in the reply and nothing is written; a request aborted before it was scheduled saves
    nothing."""
    from eagle3pipe.extract_vllm import check_file
    from eagle3pipe.records import load_hidden_states

    res = engine["connector"][run]
    spec = engine["input"]["connector_runs"][run]
    meta = toy_meta(Path(spec["verifier"]))
    assert res["layout"] == ("LBHNC" if run.endswith("LBHNC_only") else "LBNHC")
    assert res["target_block_size"] == 64  # 0.34's default block size (16 before)
    # the group our connector reads is the hidden-state layer's: the verifier's own when all its layers are full
    # attention, one of its own (block size fitted to the verifier's page) beside a hybrid verifier's
    assert res["hidden_layer_in_it"], res["groups"]
    if run.endswith("hybrid"):
        assert res["groups"][res["hidden_group"]][0] == "HiddenStateCacheSpec" and len(res["groups"]) == 3, res
    else:
        assert len(res["groups"]) == 1 and res["block_size"] == 64, res["groups"]
    assert res["block_dim"] == 2 and res["cache_shape"][2] == res["block_size"], res
    reference = load_file(str(engine["dir"] / run / "reference.safetensors"))
    written = []
    for item in spec["requests"]:
        rid, body = item["id"], item["body"]
        got = res["requests"][rid]
        path = Path(body["kv_transfer_params"]["hidden_states_path"])
        if rid == "never-scheduled":
            assert got["delay_free"] is False and got["kv_transfer_params"] is None and not path.exists()
            continue
        if rid == "outside":
            assert got["delay_free"] is False and not path.exists()
            assert got["kv_transfer_params"]["hidden_states_error"].startswith("refused: "), got
            assert "is outside the storage folder" in got["kv_transfer_params"]["hidden_states_error"]
            continue
        assert got["delay_free"] is True and got["kv_transfer_params"] == {"hidden_states_path": str(path)}
        written.append(rid)
        dtype = body["kv_transfer_params"]["storage_dtype"]
        # stage 02's own check of a file: layer ids and depth in its metadata, dtype, token ids, shape, finite
        _, finite = check_file(path, body["prompt"], meta["aux_layer_ids"], meta["num_layers"], meta["hidden_size"],
                               dtype)
        data = load_hidden_states(path)
        want = reference[rid].to(torch.bfloat16).float()  # vLLM's cache holds the model dtype
        err = ((data["hidden_states"].float() - want).abs().max() / want.abs().max()).item()
        assert finite and err <= (0.0 if dtype == "bf16" else 0.07), (rid, dtype, err)  # fp8: a scale per state
    assert res["finished_sending"] == sorted(written)
    # at start the connector names the release's status in vLLM's own log
    assert "eagle3pipe's hidden-states connector on vLLM 0.34.0: read only (sources read" in engine["log"]
