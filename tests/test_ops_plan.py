"""``run_all.sh --plan`` (eagle3pipe/costs.py): on the Kimi-K2.5 config it prints the figures a hand calculation from
that config gives, and run_all stops before stage 01b when the whole run will not fit on the disk."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from eagle3pipe.config import load_config
from eagle3pipe.draft import flat_tensor_shapes
from eagle3pipe.records import HS_FILE_HEADER_BYTES, DataDir

from test_run_all import write_config

REPO = Path(__file__).resolve().parents[1]
# Kimi-K2.5's language model, as its config.json nests it (REFERENCE.md): what a new draft takes its heads and MLP
# width from
K25_TEXT_CONFIG = {"model_type": "kimi_k2", "hidden_size": 7168, "num_attention_heads": 64, "intermediate_size": 18432,
                   "num_hidden_layers": 61, "vocab_size": 163840}


def _k25_config(tmp_path: Path, name: str = "kimi_k25") -> Path:
    """configs/<name>.yaml with its paths moved here: the data dir, and a verifier folder holding K2.5's config."""
    verifier = tmp_path / "Kimi-K2.5"
    verifier.mkdir(exist_ok=True)
    (verifier / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": K25_TEXT_CONFIG}))
    raw = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    raw["shared"].update(data_dir=str(tmp_path / "data"), verifier=str(verifier))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _table(out: str) -> dict[str, tuple[str, str, float, str]]:
    """stage -> (rows, tokens, disk GB, hours) as printed."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(0\w+|total)\s+([\d,]*|-)\s+([\d,]*|-)\s+([\d.]+)\s+([\d.]+|-)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), float(m.group(4)), m.group(5))
    return rows


def test_plan_of_the_k25_config_is_the_hand_calculation(tmp_path):
    cfg_path = _k25_config(tmp_path)
    res = subprocess.run([str(REPO / "run_all.sh"), "--config", str(cfg_path), "--plan"], capture_output=True,
                         text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, timeout=120)
    assert res.returncode == 0, res.stderr
    table = _table(res.stdout)

    # by hand, from the config's values (plan: the section's defaults, which the YAML does not set)
    c = load_config(cfg_path)
    s, g, t, ev, p = c.shared, c.generate, c.train, c.evaluate, c.plan
    questions = c.prepare.max_samples  # no prepared/ yet
    requests = min(g.max_samples, questions)
    generated = requests * min(p.completion_tokens, g.max_completion_tokens)
    assert table["01b_generate"] == (f"{requests:,}", f"{generated:,}", 0.0,
                                     f"{generated / p.generate_tokens_per_s / 3600 + p.server_start_s / 3600:.2f}")

    per_row = min(p.prompt_tokens + p.completion_tokens, s.max_seq_len)
    tokens = requests * per_row
    per_token = (len(s.aux_layer_ids) + 1) * s.hidden_size * 2 + 8  # bf16 states of 3 aux layers + the final one, id
    states_gb = (tokens * per_token + requests * HS_FILE_HEADER_BYTES) / 1e9
    assert table["02_extract"] == (f"{requests:,}", f"{tokens:,}", round(states_gb, 1),
                                   f"{tokens / p.extract_tokens_per_s / 3600 + p.server_start_s / 3600:.2f}")

    gpus = 8  # train.nproc_per_node 0 = every visible GPU
    trained = int(tokens * (1 - t.eval_fraction))
    packed = math.ceil(trained / (t.total_seq_len * p.packing_fill))  # packed rows an epoch
    steps = t.epochs * math.ceil(packed / (gpus * t.grad_accum))
    # the tensors of the draft 04 builds (draft.py's list; kv heads = heads, as fresh_layer_config sets them)
    draft = flat_tensor_shapes({**K25_TEXT_CONFIG, "head_dim": t.draft_head_dim, "num_key_value_heads": 64,
                                "draft_vocab_size": s.draft_vocab_size, "vocab_size": s.vocab_size})
    params = sum(math.prod(shape) for name, shape in draft.items() if name not in ("d2t", "t2d"))
    lm_head = math.prod(draft["lm_head.weight"])
    maps = 8 * s.draft_vocab_size + s.vocab_size  # d2t int64, t2d bool
    checkpoint = 4 * params + 8 * (params - lm_head) + maps  # fp32 weights, AdamW's 2 moments (lm_head frozen)
    assert round(checkpoint / 1e9, 2) == 12.46  # what a real K2.5 checkpoint measured (README 04_train.py)
    written = steps // t.checkpoint_every + 1  # every checkpoint_every steps, and at the end (603 is no multiple)
    assert steps % t.checkpoint_every
    on_disk = min(t.keep_checkpoints, written) + (1 if written > t.keep_checkpoints else 0)
    train_gb = (on_disk * checkpoint + 2 * params + maps) / 1e9
    hours = t.epochs * trained / (p.train_tokens_per_s * gpus * p.train_scaling) / 3600
    assert table["04_train"] == (f"{packed * t.epochs:,}", f"{t.epochs * trained:,}", round(train_gb, 1),
                                 f"{hours:.2f}")
    assert f"{steps} steps on {gpus} process(es)" in res.stdout

    sets, columns = len(ev.benchmarks), 2  # the draft and the verifier alone (evaluate.baseline)
    per_pass = sets * ev.num_prompts * ev.max_completion_tokens
    hours = columns * sum(per_pass / (level * p.evaluate_tokens_per_s) for level in ev.concurrency) / 3600 \
        + 2 * p.server_start_s / 3600
    assert table["05_evaluate"] == (f"{columns * len(ev.concurrency) * sets * ev.num_prompts:,}",
                                    f"{columns * len(ev.concurrency) * per_pass:,}", 0.0, f"{hours:.2f}")
    assert table["total"][2] == round(states_gb + train_gb, 1)
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    m = re.search(r"disk: ([\d.]+) GB needed \(([\d.]+) GB if every row reached max_seq_len\), ([\d.]+) GB free",
                  res.stdout)
    bound_gb = (requests * s.max_seq_len * per_token + requests * HS_FILE_HEADER_BYTES) / 1e9 + train_gb
    assert m and float(m.group(2)) == round(bound_gb, 1) and abs(float(m.group(3)) - free_gb) < 1.0


def test_run_all_stops_before_01b_when_the_run_will_not_fit_on_the_disk(tmp_path, toy_llama):
    # a checkpoint of 10^6 GB every step: no disk holds the run
    cfg_path = write_config(tmp_path, toy_llama, plan={"checkpoint_gb": 1e6}, train={"checkpoint_every": 1})
    dd = DataDir(tmp_path / "data")
    args = [str(REPO / "run_all.sh"), "--config", str(cfg_path), "--vllm-url", "http://127.0.0.1:9", "--to", "04"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "01_prepare: finished" in res.stderr  # 01 ran: the plan counts its questions
    questions = sum(1 for _ in open(dd.questions))
    assert f"plan for {cfg_path} (data dir {dd.root}): {questions} questions (prepared/questions.jsonl)" in res.stdout
    assert re.search(r"error: the run needs [\d.]+ GB on \S+ \(.*04_train [\d.]+ GB\) but [\d.]+ GB are free",
                     res.stdout + res.stderr)
    assert "FAILED before stage 01b_generate: the plan's disk check" in res.stderr
    assert not dd.synthetic.exists() and not dd.log_file("01b_generate").exists()  # 01b never started

    forced = write_config(tmp_path, toy_llama, plan={"checkpoint_gb": 1e6}, train={"checkpoint_every": 1},
                          extract={"force_disk": True})
    res = subprocess.run([*args[:2], str(forced), *args[3:]], capture_output=True, text=True, timeout=600)
    assert "extract.force_disk is set: starting anyway" in res.stdout + res.stderr
    assert "01b_generate: running" in res.stderr  # (and fails: nothing listens on port 9)


def _plan(argv: list[str], capsys) -> tuple[int, str]:
    """``python -m eagle3pipe.costs`` (run_all.sh --plan execs it), in this process: (exit status, stdout + stderr)."""
    from eagle3pipe.costs import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def test_plan_sizes_the_dflash_draft_04_builds_and_marks_its_rate_unmeasured(tmp_path, monkeypatch, capsys):
    """Issue 47: --plan sized a DFlash draft with EAGLE-3's formula (1,116 M trained parameters, 14.3 GB a checkpoint)
    and priced its hours at EAGLE-3's measured rate without saying so. By hand, from z-lab's K2.5 DFlash layout that
    configs/kimi_k25_dflash.yaml asks for, and against speculators' DFlashDraftModel built on the meta device."""
    import torch
    from speculators.models.dflash import DFlashDraftModel

    from eagle3pipe.costs import draft_size
    from eagle3pipe.draft import VERIFIER_OWNED_KEYS

    cfg_path = _k25_config(tmp_path, "kimi_k25_dflash")
    c = load_config(cfg_path)
    s, t = c.shared, c.train
    h, heads, kv, hd, mlp, n = s.hidden_size, t.draft_num_heads, t.dflash_num_kv_heads, t.draft_head_dim, \
        t.draft_intermediate_size, t.dflash_num_layers
    layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd + 3 * h * mlp + 2 * h  # q k v o, q/k norm, MLP
    fc = h * len(c.draft_layer_ids) * h
    lm_head = s.draft_vocab_size * h
    params = n * layer + fc + 2 * h + lm_head  # + hidden_norm and norm
    trained = params - lm_head  # lm_head frozen (train.train_lm_head false)
    assert round(trained / 1e6) == 3479 and round(params / 1e6) == 3709
    maps = 8 * s.draft_vocab_size + s.vocab_size
    checkpoint = 4 * params + 8 * trained + maps
    assert round(checkpoint / 1e9, 1) == 42.7

    size = draft_size(c)
    assert (size.family, size.params, size.trainable, size.checkpoint_bytes) == ("dflash", params, trained, checkpoint)
    # the same model built by speculators alone on the meta device (its own from_training_args path: the count
    # does not rest on our build)
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer_cfg = Qwen3Config(hidden_size=h, intermediate_size=mlp, num_hidden_layers=n, num_attention_heads=heads,
                            num_key_value_heads=kv, head_dim=hd, vocab_size=s.vocab_size)
    with torch.device("meta"):
        model = DFlashDraftModel(DFlashSpeculatorConfig(
            transformer_layer_config=layer_cfg, draft_vocab_size=s.draft_vocab_size, block_size=8, mask_token_id=0,
            aux_hidden_state_layer_ids=c.draft_layer_ids,
            speculators_config=SpeculatorsConfig(
                algorithm="dflash", default_proposal_method="greedy",
                proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=7)],
                verifier=VerifierConfig(name_or_path=None, architectures=[]))))
    own = sum(v.numel() for k, v in model.state_dict().items() if k not in VERIFIER_OWNED_KEYS
              and v.is_floating_point())
    assert own == params

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    code, out = _plan(["--config", str(cfg_path)], capsys)
    assert code == 0, out
    table = _table(out)
    steps = int(re.search(r"(\d+) steps on 8 process", out).group(1))
    written = steps // t.checkpoint_every + (1 if steps % t.checkpoint_every else 0)
    on_disk = min(written, t.keep_checkpoints + 1)
    assert table["04_train"][2] == round((on_disk * checkpoint + 2 * params + maps) / 1e9, 1)
    assert f"dflash draft: {params / 1e6:,.0f} M parameters, {trained / 1e6:,.0f} M trained" in out
    assert "27700 tok/s a process (EAGLE-3's, measured on one H200; NOT MEASURED for a dflash draft)" in out
    assert "extract_tokens_per_s 16000 (projected)" in out and "packing_fill 0.927 (measured)" in out


def test_plan_on_a_node_without_gpus_and_without_the_verifier(tmp_path, monkeypatch, capsys):
    """A login node: no GPU visible, so 04 is planned on the GPUs of the node the config's servers ask for (8 for
    K2.5), saying so; without the verifier's config.json the checkpoints cannot be sized: the plan says so where the
    disk is given, and the disk check before 01b refuses rather than passing a run that stops days later."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg_path = _k25_config(tmp_path)
    code, out = _plan(["--config", str(cfg_path)], capsys)
    assert code == 0, out
    assert "steps on 8 process(es) (NO GPU VISIBLE HERE: planned on the 8 GPUs of the node" in out
    assert re.search(r"^04 on 8 process\(es\): NO GPU VISIBLE HERE", out, re.M)

    (tmp_path / "Kimi-K2.5" / "config.json").unlink()
    code, out = _plan(["--config", str(cfg_path)], capsys)
    assert code == 0 and re.search(r"^DISK NOT COUNTED: 04's checkpoints \(\d+ written, \d+ on disk at once\): the "
                                   r"eagle3 draft cannot be sized without the verifier's config.json", out, re.M), out
    code, out = _plan(["--config", str(cfg_path), "--check-disk"], capsys)
    assert code == 2 and "error: the plan cannot size 04's checkpoints" in out


def test_plan_sizes_the_mla_draft_04_builds(tmp_path):
    """Issue 48: configs/kimi_k25_mla.yaml's draft (train.draft eagle3_mla) is sized from the model 04 builds
    (Eagle3MLAFamily.new_model on the meta device), equal to the independent count from its exported tensor shapes
    (draft_mla.parameter_counts: the layout vLLM's Eagle3DeepseekV2ForCausalLM loads)."""
    from eagle3pipe import draft_mla
    from eagle3pipe.costs import draft_size

    path = _k25_config(tmp_path, "kimi_k25_mla")
    release = {**K25_TEXT_CONFIG, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128}  # K2.5's MLA (REFERENCE.md)
    (tmp_path / "Kimi-K2.5" / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": release}))
    c = load_config(path)
    assert c.train.draft == "eagle3_mla"
    size = draft_size(c)
    assert size.family == "eagle3_mla"
    assert (size.params, size.trainable) == draft_mla.parameter_counts(c)
