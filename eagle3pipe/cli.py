"""The shared door of every numbered script: parse flags over YAML, set up logging, lock the stage, run it.

Known failures (bad config, missing file, wrong token ids, a refused preflight) end as one line on stderr naming
the culprit, exit status 2; anything else is a bug and keeps its traceback. Every stage holds its lock in the data
dir while it runs (``locks.py``: a second copy refuses, naming the first). SIGTERM (what ``run_all.sh`` forwards
when it is stopped) and Ctrl-C unwind the stage like an error, so files are flushed and the lock released; the
exit status is then 128 + the signal number and a rerun of the same command resumes.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import sys
import threading
from typing import Callable

from .config import ConfigError, PipelineConfig, parse_stage_args
from .locks import StageLock, StageLockedError
from .progress import setup_logging
from .records import DataDir

log = logging.getLogger("eagle3pipe")


class StageError(RuntimeError):
    """A stage refuses to go on; the message says what was found and which flag or file fixes it."""


def errors_allowed(max_error_share: float, total: int) -> int:
    """How many of ``total`` items may stay errored (retryable: a rerun retries them) while a stage still finishes:
    ``--max-error-share`` of 01b and 02, one rule for both."""
    return int(max_error_share * total)


class StageInterrupted(SystemExit):
    """SIGTERM arrived. A SystemExit, so asyncio and library code let it through as they do a real exit."""


def _on_sigterm(signum, frame) -> None:
    for child in multiprocessing.active_children():  # e.g. stage 02's workers: no orphan keeps writing
        child.terminate()
    raise StageInterrupted(128 + signal.SIGTERM)


def run_stage(stage: str, log_name: str | Callable[[PipelineConfig], str], fn: Callable[[PipelineConfig], object],
              description: str | None, argv: list[str] | None = None) -> int:
    """Parse ``argv`` for ``stage``, log to ``<data_dir>/logs/<log_name>.log``, hold the stage's lock, call
    ``fn(cfg)``; return the exit code. ``log_name`` may depend on the config (04's --export-from runs beside a
    training under its own log and lock)."""
    from .chat import ChatError, TokenIdMismatch
    from .records import FormatError

    try:
        cfg = parse_stage_args(stage, argv, description)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if callable(log_name):
        log_name = log_name(cfg)
    dd = DataDir(cfg.data_dir)
    rank = torchrun_rank()
    # under torchrun (stage 04) rank 0 logs, prints and holds the lock for the whole job; every other rank logs to
    # its own file and prints warnings and errors only, so the terminal shows one run
    setup_logging(dd.log_file(log_name if rank == 0 else f"{log_name}.rank{rank}"))
    if rank:
        for h in logging.getLogger().handlers:
            if getattr(h, "_eagle3pipe", False) and type(h) is logging.StreamHandler:
                h.setLevel(logging.WARNING)
    lock = StageLock(dd.stage_lock(log_name), log_name)
    try:
        if rank == 0:
            lock.acquire()
    except StageLockedError as e:
        log.error("%s refused: %s", log_name, e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
    previous_handler = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    try:
        log.info("%s: config from %s: %s", log_name, cfg.source, cfg.to_dict().get(stage, {}))
        log.info("%s: shared: %s", log_name, cfg.to_dict()["shared"])
        fn(cfg)
    except (ConfigError, StageError, ChatError, TokenIdMismatch, FormatError, FileNotFoundError) as e:
        log.error("%s failed: %s", log_name, e)
        print(f"error: rank {rank}: {e}" if rank else f"error: {e}", file=sys.stderr)
        return 2
    except StageInterrupted as e:
        log.warning("%s stopped by SIGTERM; what it finished is kept: rerun the same command to resume", log_name)
        return int(e.code)
    except KeyboardInterrupt:
        log.warning("%s stopped by Ctrl-C; what it finished is kept: rerun the same command to resume", log_name)
        return 128 + signal.SIGINT
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous_handler)
        if rank == 0:
            lock.release()
    return 0


def torchrun_rank() -> int:
    """This process's rank when torchrun started it (RANK with WORLD_SIZE set), else 0."""
    import os

    return int(os.environ.get("RANK", "0")) if "WORLD_SIZE" in os.environ else 0
