"""Logging and progress, one convention for every stage.

Each stage logs to the terminal and appends to ``<data_dir>/logs/<stage>.log``. Progress is a tqdm bar when stderr
is a terminal; under nohup (no TTY) it is a plain line every ``every_s`` seconds that reads well in ``tail -f``::

    Progress: 2680/25000 (222 errors), 0.5 req/s, avg completion: 1263 tokens, elapsed: 5945s, eta: 3h10m
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(log_file: Path | None, level: int = logging.INFO) -> None:
    """Send the package's log records to stderr and, when given, append them to ``log_file``."""
    root = logging.getLogger()
    root.setLevel(level)
    for h in list(root.handlers):
        if getattr(h, "_eagle3pipe", False):
            root.removeHandler(h)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, encoding="utf-8"))
    for h in handlers:
        h.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        h._eagle3pipe = True  # so a second setup (tests) replaces, not duplicates, our handlers
        root.addHandler(h)
    for noisy in ("httpx", "httpx2", "httpcore", "openai", "urllib3", "filelock", "datasets", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def format_duration(seconds: float) -> str:
    """3h10m / 12m05s / 42s: short and unambiguous in a log line."""
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


# what ``Progress.line`` prints (after the log record's "DATE TIME LEVEL logger: " prefix); ``parse_line`` reads it back
PROGRESS_LINE = re.compile(r"(?P<desc>[^:]+): (?P<done>\d+)/(?P<total>\d+) \((?P<errors>\d+) errors\), "
                           r"(?P<rate>[\d.]+) (?P<unit>\S+)/s(?P<extra>.*), "
                           r"elapsed: (?P<elapsed>\d+)s, eta: (?P<eta>\S+)$")


def parse_line(message: str) -> dict | None:
    """The fields of a progress line (``Progress.line``'s text; a log line's prefix is skipped), or None."""
    if " INFO " in message[:40]:  # a log record: "2026-12-02 10:00:00 INFO eagle3pipe.progress: Progress: ..."
        message = message.split(" INFO ", 1)[1].split(": ", 1)[-1]
    m = PROGRESS_LINE.match(message.strip())
    if m is None:
        return None
    d = m.groupdict()
    return {"desc": d["desc"], "done": int(d["done"]), "total": int(d["total"]), "errors": int(d["errors"]),
            "rate": float(d["rate"]), "unit": d["unit"], "elapsed_s": int(d["elapsed"]), "eta": d["eta"]}


class Progress:
    """Counts done/errors against a total and reports rate, extra fields, elapsed and eta.

    ``fields`` passed to ``update``/``set_fields`` are shown after the rate in insertion order, e.g.
    ``{"avg completion": "1263 tokens"}``.
    """

    def __init__(self, total: int, *, unit: str = "samples", rate_unit: str | None = None, every_s: float = 30.0,
                 logger: logging.Logger | None = None, initial: int = 0, desc: str = "Progress",
                 use_tty: bool | None = None, errors_label: str = "errors", show_zero_errors: bool = True):
        self.total = total
        self.errors_label = errors_label  # what ``errors`` counts, as the line names it (04: "skipped samples")
        self.show_zero_errors = show_zero_errors  # False: the count appears only once there is one
        self.unit = unit
        self.rate_unit = rate_unit or unit
        self.every_s = every_s
        self.log = logger or logging.getLogger("eagle3pipe.progress")
        self.initial = initial  # done before this run (resume): counted in done, not in the rate
        self.done = initial
        self.errors = 0
        self.fields: dict[str, str] = {}
        self.desc = desc
        self.start = time.monotonic()
        self._last_line = self.start
        tty = sys.stderr.isatty() if use_tty is None else use_tty
        self._bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, file=sys.stderr) if tty else None

    def update(self, n: int = 1, errors: int = 0, **fields: str) -> None:
        self.done += n
        self.errors += errors
        self.fields.update({k.replace("_", " "): v for k, v in fields.items()})
        if self._bar is not None:
            self._bar.update(n)
            self._bar.set_postfix_str(self._postfix(), refresh=False)
        elif time.monotonic() - self._last_line >= self.every_s:
            self.log.info(self.line())
            self._last_line = time.monotonic()

    def add_total(self, n: int) -> None:
        """More work became known (04 online queues its rows as it plans them)."""
        self.total += n
        if self._bar is not None:
            self._bar.total = self.total

    def set_fields(self, **fields: str) -> None:
        self.update(0, **fields)

    def rate(self) -> float:
        elapsed = time.monotonic() - self.start
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def _errors(self) -> str:
        return f"{self.errors} {self.errors_label}" if self.errors or self.show_zero_errors else ""

    def _postfix(self) -> str:
        parts = [self._errors()] * bool(self._errors()) + [f"{k}: {v}" for k, v in self.fields.items()]
        return ", ".join(parts)

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        rate = self.rate()
        remaining = max(0, self.total - self.done)
        eta = format_duration(remaining / rate) if rate > 0 else "?"
        extra = "".join(f", {k}: {v}" for k, v in self.fields.items())
        return (
            f"{self.desc}: {self.done}/{self.total}{f' ({self._errors()})' if self._errors() else ''}, "
            f"{rate:.1f} {self.rate_unit}/s{extra}, "
            f"elapsed: {int(elapsed)}s, eta: {eta}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self.log.info(self.line())
