"""The CPU demo, reduced for CI: demo.sh end to end (toy reasoning verifier, real vLLM CPU server, every stage
through run_all.sh) on a few dozen prompts; the draft it trains must be accepted by vLLM (acceptance length > 1)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from eagle3pipe.records import DataDir, load_eval_report

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_reduced_demo_end_to_end(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data = tmp_path / "demo"
    cfg["shared"]["data_dir"] = str(data)
    cfg["shared"]["verifier"] = str(data / "verifier")
    cfg["prepare"]["dataset"] = [str(data / "chats.jsonl")]
    cfg["prepare"]["max_samples"] = 48
    cfg["generate"]["max_samples"] = 48
    # a verifier trained this briefly often loops until the length cap: keep those answers, they are still its own
    cfg["generate"]["include_truncated"] = True
    cfg["evaluate"].update(prompts=str(data / "eval_prompts.jsonl"), num_prompts=24, baseline=False)
    cfg_path = tmp_path / "demo_ci.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, CONFIG=str(cfg_path), DEMO_SKIP_SETUP="1",
               DEMO_VERIFIER_ARGS="--steps 120 --num-train-tasks 800 --num-chats 200 --num-eval 40")
    res = subprocess.run([str(REPO / "demo.sh")], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, f"demo.sh failed:\n{res.stderr[-4000:]}"
    report = load_eval_report(DataDir(data))
    wd = report["with_draft"]
    assert wd["requests"] == 24 and wd["drafts"] > 0
    assert wd["acceptance_length"] > 1.0, json.dumps(wd)
    assert "| acceptance length (1 + accepted / drafts) |" in res.stdout  # the table is printed at the end
    for stage in ("01_prepare", "01b_generate", "02_extract", "03_vocab", "04_train", "05_evaluate"):
        assert DataDir(data).stage_marker(stage).is_file(), stage
    assert not subprocess.run(["pgrep", "-f", f"--model {data / 'verifier'}"], capture_output=True).stdout, \
        "demo.sh left a vLLM server running"
