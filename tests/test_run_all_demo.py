"""The CPU demo, reduced for CI: demo.sh end to end (the shipped toy reasoning verifier, real vLLM CPU server, every
stage through run_all.sh) on a few dozen prompts; the draft it trains must be accepted by vLLM.

No fixed timeout: the watchdog (tests/watch.py) stops demo.sh only when it stalls (no output, no CPU), so a busy
machine slows the test down without failing it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from eagle3pipe.records import DataDir, read_jsonl
from eagle3pipe.records_eval import load_eval_report

from test_server_lifecycle import _server_group
from watch import run_watched

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_reduced_demo_end_to_end(tmp_path):
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data = tmp_path / "demo"
    cfg["shared"]["data_dir"] = str(data)
    cfg["prepare"]["dataset"] = [str(data / "chats.jsonl")]
    cfg["prepare"]["max_samples"] = 48
    cfg["generate"]["max_samples"] = 48
    cfg["evaluate"].update(prompts=str(data / "eval_prompts.jsonl"), num_prompts=16, baseline=False)
    # 04 on 2 processes (issue 17): run_all.sh starts torchrun (gloo), rank 0 exports, 05's vLLM speculates with it.
    # The demo's 6 epochs are ~25 steps of 2 packed rows here; at its learning rate (1e-3) they left acceptance at
    # 1.35 (12 epochs: 1.88, 2026-12-03); 3e-3 makes up for the fewer steps. The full demo's figures are README's
    cfg["train"].update(nproc_per_node=2, learning_rate=0.003)
    cfg_path = tmp_path / "demo_ci.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, CONFIG=str(cfg_path), DEMO_SKIP_SETUP="1")
    res = run_watched([str(REPO / "demo.sh")], log_file=tmp_path / "demo.out", stall_s=600, env=env, cwd=REPO)
    assert res.returncode == 0, f"demo.sh failed:\n{res.stdout[-4000:]}"
    report = load_eval_report(DataDir(data))
    wd = report["with_draft"]
    assert wd["requests"] == 16 and wd["drafts"] > 0
    # the shipped verifier and 48 regenerated answers: measured 1.6-1.7 (README); a draft that learned nothing
    # stays near 1.0
    assert wd["acceptance_length"] > 1.3, json.dumps(wd)
    assert "### Acceptance length (1 + accepted / drafts)" in res.stdout  # the tables are printed at the end
    assert "| benchmark | draft |" in res.stdout and "| eval_prompts |" in res.stdout  # row = the prompt file
    for stage in ("01_prepare", "01b_generate", "02_extract", "03_vocab", "04_train", "05_evaluate"):
        assert DataDir(data).stage_marker(stage).is_file(), stage
    assert "04_train: on torch.distributed.run --standalone --nproc-per-node 2" in res.stdout
    rows = [r for r in read_jsonl(DataDir(data).train_metrics) if r["kind"] == "rows"]
    assert rows and all(len(r["rows_per_rank"]) == 2 and r["rows"] == r["packed_rows"] for r in rows), rows
    assert (data / "logs" / "04_train.rank1.log").is_file()
    port = (data / "logs" / ".demo_vllm_ready").read_text().strip().rsplit(":", 1)[1]
    assert _server_group(f"--port {port} ") is None, "demo.sh left its generation server running"
    assert _server_group(str(data)) is None, "stage 05 left its vLLM server running"
