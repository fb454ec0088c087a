"""requirements.txt names every third-party package the code imports, exactly pinned where the API we call moved
across major versions (openai 2 -> 3 moved from httpx to httpx2: an environment built from `openai>=2.0.0` and
`httpx` failed at `import httpx2`)."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = ["eagle3pipe", "tests", "bench"]
# Installed by scripts/setup_env.sh outside requirements.txt (torch first and pinned; speculators --no-deps), or
# only present in the vLLM server environment (.venv-vllm), where the connector module is imported.
INSTALLED_BY_SETUP = {"torch", "speculators", "hs-connectors"}
# setproctitle and prometheus-client: vLLM's own dependencies, used there by tests/vllm_zygote.py and
# tests/vllm034_probe.py (run in vLLM 0.34's interpreter)
VLLM_ENV_ONLY = {"vllm", "setproctitle", "prometheus-client"}
# Pinned with ==: a different major version changes the API or the token ids we rely on.
MUST_PIN_EXACTLY = {"openai", "httpx2", "transformers", "datasets", "tiktoken"}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_specs() -> dict[str, str]:
    specs = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", line).group(0)
        specs[_normalise(name)] = line[len(name):].strip()
    return specs


def imported_top_level_modules() -> dict[str, str]:
    """Top-level module -> first file importing it, over every .py file of the package, tests and benchmarks."""
    local = {p.stem for d in SOURCES for p in (REPO / d).glob("*.py")} | set(SOURCES)
    found: dict[str, str] = {}
    for d in SOURCES:
        for path in sorted((REPO / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in local and top not in sys.stdlib_module_names:
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_every_imported_package_is_listed_and_the_moving_ones_pinned():
    specs = requirement_specs()
    dists_of = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(imported_top_level_modules().items()):
        dists = {_normalise(d) for d in dists_of.get(module, [])} or {_normalise(module)}
        if dists & (INSTALLED_BY_SETUP | VLLM_ENV_ONLY):
            continue
        if not dists & specs.keys():
            missing.append(f"{module} (imported in {where}; distribution {sorted(dists)})")
    assert not missing, "imported but not in requirements.txt: " + "; ".join(missing)
    for name in MUST_PIN_EXACTLY:
        assert specs.get(name, "").startswith("=="), f"{name} must be pinned with == in requirements.txt"


def test_pinned_versions_are_the_installed_ones():
    """The environment the tests run in is the one requirements.txt describes (a stale venv would hide a bad pin)."""
    for name, spec in requirement_specs().items():
        if spec.startswith("=="):
            assert importlib.metadata.version(name) == spec[2:], name
