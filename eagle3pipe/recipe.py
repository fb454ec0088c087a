"""Print the exact per-node commands of a run over two nodes, for the user's config (``run_all.sh --print-recipe``).

    ./run_all.sh --config configs/kimi_k25.yaml --print-recipe two-node [--nodes gpu-a,gpu-b]
    python -m eagle3pipe.recipe --config configs/kimi_k25.yaml two-node [--nodes gpu-a,gpu-b]
    ./run_all.sh --config configs/kimi_k25.yaml --print-recipe two-node --verifier-config config.json  # login node

Two 8-GPU nodes, node 0 and node 1, sharing ``shared.data_dir`` at the same path (NFS, Lustre: the extraction
servers write the states into it and the stages read them): both nodes serve the verifier for 01b and for 02 (one
server each, data parallel over the two URLs, the clients on node 0); 04 trains offline on both nodes under
torchrun (16 ranks) or, with ``train.data_source: online``, on node 1 while node 0 serves the states; 05 runs on
node 0 with the servers it starts. The extraction server commands are the ones ``python -m eagle3pipe.extract_vllm
--host 0.0.0.0`` prints (stage 02's own flags); every server that listens beyond loopback requires
``$VLLM_API_KEY`` (the same secret exported on both nodes), which every client of ours sends.

Each command names the environment that runs it (scripts/setup_env.sh --gpu makes both): ``.venv/bin/python`` for
our stages and torchrun (``-m torch.distributed.run``), the vLLM interpreter (``.venv-vllm/bin/python -m
vllm.entrypoints.cli.main serve`` = ``vllm serve``) for the servers: ``.venv`` has no vLLM, ``.venv-vllm`` no
speculators. The verifier folder is read only for its layer count; on a node without it (a login node)
``--verifier-config`` gives its config.json alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from pathlib import Path

from .config import ConfigError, load_config
from .records import DataDir

RECIPES = ("two-node",)
SERVER_PORT = 8000  # vLLM's default port: the URLs below
RDZV_PORT = 29500  # torchrun's default c10d rendezvous port
PYTHON = ".venv/bin/python"  # the project's environment: every numbered script and torchrun
TORCHRUN = f"{PYTHON} -m torch.distributed.run"


@contextlib.contextmanager
def _printing_api_key():
    """``extract_vllm.serve_command`` refuses a non-loopback host while ``$VLLM_API_KEY`` is unset (it would start an
    open server). Here it only prints the command, which names the variable, never its value: let it print."""
    from .vllm_client import API_KEY_ENV

    unset = API_KEY_ENV not in os.environ
    if unset:
        os.environ[API_KEY_ENV] = "printing-a-recipe"
    try:
        yield
    finally:
        if unset:
            os.environ.pop(API_KEY_ENV)


def _q(words: list[str]) -> str:
    return " ".join(shlex.quote(str(w)) for w in words)


def verifier_layers(cfg, verifier_config: str | None) -> int:
    """The verifier's layer count (the extraction server's final-state id): from ``verifier_config`` (a copy of its
    config.json) when given, else from the verifier folder's."""
    from .cli import StageError
    from .verifier import load_text_config

    if verifier_config:
        try:
            config = json.loads(Path(verifier_config).read_text())
            return int((config.get("text_config") or config)["num_hidden_layers"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--verifier-config {verifier_config}: not a model config.json with "
                              f"num_hidden_layers ({e})") from None
    try:
        return load_text_config(cfg.shared.verifier, cfg.shared.trust_remote_code)[0].num_hidden_layers
    except (StageError, OSError, ValueError) as e:
        raise ConfigError(f"{e}; on a node without the verifier folder pass --verifier-config with a copy of its "
                          "config.json (the recipe needs its layer count alone)") from None


def two_node(config_path: str, nodes: tuple[str, str], verifier_config: str | None = None) -> str:
    """The two-node recipe for ``config_path``, as text (shell comments + commands, one block per step)."""
    from .extract_vllm import serve_command, vllm_serve
    from .vllm_client import API_KEY_ENV

    cfg = load_config(config_path)
    config = str(Path(config_path).resolve())
    dd = DataDir(cfg.data_dir)
    n0, n1 = nodes
    url0, url1 = f"http://{n0}:{SERVER_PORT}", f"http://{n1}:{SERVER_PORT}"
    remote = " --trust-remote-code" if cfg.shared.trust_remote_code else ""
    gen_args = _q(cfg.generate.server_args) if cfg.generate.server_args else ""
    online = cfg.train.data_source == "online"
    with _printing_api_key():
        extract_server = serve_command(cfg, dd.hs_work, host="0.0.0.0",
                                       num_layers=verifier_layers(cfg, verifier_config))
    nproc = str(cfg.train.nproc_per_node) if cfg.train.nproc_per_node > 0 else "gpu"  # gpu: every GPU of the node
    L = [f"# Two-node recipe for {config}",
         f"# node 0 = {n0}, node 1 = {n1}. Both see the data dir {Path(cfg.data_dir).resolve()} at this same path "
         "(shared storage),",
         "# have this repository at the same path (the extraction servers load our connector from it) and the same",
         "# environments (scripts/setup_env.sh --gpu). Commands run from the repository root, each in the",
         f"# environment that runs it: {PYTHON} (torch, transformers, speculators: our stages and torchrun) or",
         f"# {vllm_serve()} (= vllm serve of the vLLM environment; {PYTHON} has no vLLM).",
         "",
         "## both nodes, once per shell: one secret, the same on both (servers reachable from the other node",
         "## require it; the stages send it)",
         f"export {API_KEY_ENV}=<one secret>",
         f"./run_all.sh --config {shlex.quote(config)} --check",
         "",
         "## 01 prepare: node 0 (CPU only)",
         f"{PYTHON} 01_prepare_data.py --config {shlex.quote(config)}",
         "",
         "## 01b generate: a verifier server on each node, the client on node 0",
         "# node 0 and node 1 (leave running until 01b exits 0; then stop both):",
         f"{vllm_serve()} {shlex.quote(cfg.shared.verifier)} --host 0.0.0.0 --port {SERVER_PORT} "
         f"--api-key \"${API_KEY_ENV}\"{remote}" + (f" {gen_args}" if gen_args else ""),
         ]
    if not gen_args:
        L.append("#   (generate.server_args is empty in this config: add --tensor-parallel-size and "
                 "--reasoning-parser kimi_k2 for K2.5)")
    L += ["# node 0, once both answer on /health:",
          f"{PYTHON} 01b_generate_synthetic.py --config {shlex.quote(config)} --vllm-url {url0} --vllm-url {url1}",
          ""]
    if not online:  # online, 04 gets the states from the servers as it trains: no hidden_states/ to write
        L += [
          "## 02 extract: an extraction server on each node (it writes into the shared data dir), the client on node 0",
          "# node 0 and node 1 (stop both once 02 exits 0):",
          extract_server,
          "# node 0, once both answer on /health:",
          f"{PYTHON} 02_extract_hidden_states.py --config {shlex.quote(config)} --extract-url {url0} "
          f"--extract-url {url1}",
          ""]
    L += ["## 03 vocab: node 0",
          f"{PYTHON} 03_build_vocab_mapping.py --config {shlex.quote(config)}",
          ""]
    if online:
        L += ["## 04 train, online (train.data_source: online): node 0 serves the states, node 1 trains",
              "# node 0 (stage 02's extraction server, writing into the shared data dir):",
              extract_server,
              "# node 1 (the spool lives in the shared data dir, inside the server's storage folder):",
              f"{TORCHRUN} --standalone --nproc-per-node {nproc} 04_train.py --config {shlex.quote(config)} "
              f"--extract-url {url0}",
              ""]
    else:
        L += ["## 04 train, offline: both nodes train (every rank reads hidden_states/ from the shared data dir;",
              "## rank 0, on node 0, writes checkpoints/). The same command on each node:",
              f"{TORCHRUN} --nnodes 2 --nproc-per-node {nproc} --rdzv-backend c10d --rdzv-endpoint {n0}:{RDZV_PORT} "
              f"--rdzv-id eagle3pipe-04 04_train.py --config {shlex.quote(config)}",
              "# after a failure: the same command on both nodes with --resume",
              ""]
    L += ["## 05 evaluate: node 0, its GPUs free (05 starts the draft's and the verifier's servers itself)",
          f"{PYTHON} 05_evaluate.py --config {shlex.quote(config)}",
          "",
          "## any time, from either node",
          f"./run_all.sh --config {shlex.quote(config)} --status"]
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print the exact per-node commands of a multi-node run for a config, "
                                            "as run_all.sh's print-recipe option does.")
    p.add_argument("recipe", choices=RECIPES, help="which recipe")
    p.add_argument("--config", required=True, help="the run's YAML config")
    p.add_argument("--nodes", default="node0,node1",
                   help="the two nodes' host names, comma-separated: node 0 first (default: node0,node1)")
    p.add_argument("--verifier-config", default=None,
                   help="a copy of the verifier's config.json, on a node without the verifier folder (a login node): "
                        "the recipe needs its layer count alone")
    args = p.parse_args(argv)
    nodes = tuple(n.strip() for n in args.nodes.split(","))
    if len(nodes) != 2 or not all(nodes):
        print(f"error: --nodes {args.nodes!r}: give two host names, comma-separated (node 0 first)", file=sys.stderr)
        return 2
    try:
        print(two_node(args.config, nodes, args.verifier_config), end="")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the verifier's config unreadable (serve_command reads its layer count)
        from .cli import StageError

        if isinstance(e, (StageError, OSError, ValueError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
