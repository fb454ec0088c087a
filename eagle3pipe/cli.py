"""The shared door of every numbered script: parse flags over YAML, set up logging, run one stage function.

Known failures (bad config, missing file, wrong token ids, a refused preflight) end as one line on stderr naming
the culprit, exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

from .config import ConfigError, PipelineConfig, parse_stage_args
from .progress import setup_logging
from .records import DataDir

log = logging.getLogger("eagle3pipe")


class StageError(RuntimeError):
    """A stage refuses to go on; the message says what was found and which flag or file fixes it."""


def run_stage(stage: str, log_name: str, fn: Callable[[PipelineConfig], object], description: str | None,
              argv: list[str] | None = None) -> int:
    """Parse ``argv`` for ``stage``, log to ``<data_dir>/logs/<log_name>.log``, call ``fn(cfg)``; return exit code."""
    from .chat import ChatError, TokenIdMismatch
    from .records import FormatError

    try:
        cfg = parse_stage_args(stage, argv, description)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging(DataDir(cfg.data_dir).log_file(log_name))
    log.info("%s: config from %s: %s", log_name, cfg.source, cfg.to_dict()[stage] if stage in cfg.to_dict() else {})
    log.info("%s: shared: %s", log_name, cfg.to_dict()["shared"])
    try:
        fn(cfg)
    except (ConfigError, StageError, ChatError, TokenIdMismatch, FormatError, FileNotFoundError) as e:
        log.error("%s failed: %s", log_name, e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
