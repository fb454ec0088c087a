"""What a stage's row handling allocates per row, deterministically: the tracemalloc peak (Python objects and numpy
arrays; memory maps are not allocations) of the same call at two row counts. The constant part (a tokenizer, the
imports' caches) cancels in the difference; a structure that grows with the rows does not."""

from __future__ import annotations

import functools
import gc
import logging
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Callable

CHILD_ENV = "EAGLE3PIPE_MEMORY_TEST_CHILD"


def peak_allocated(fn: Callable[[], object]) -> int:
    """Bytes: the highest the traced heap got above where it stood when ``fn`` started."""
    gc.collect()
    # pytest's log capture keeps every record in memory; once another test has set the root logger to INFO, a stage's
    # progress lines (one a row at progress_every_s 0) would count as the stage's allocation (CI: 1,201 bytes a row)
    logging.disable(logging.CRITICAL)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)


def bytes_per_row(run: Callable[[int], Callable[[], object]], small: int, large: int) -> float:
    """(peak at ``large`` rows - peak at ``small`` rows) / (large - small). ``run(n)`` sets up n rows (untraced)
    and returns the call to measure; each call of ``run`` must set up afresh (its own folder). A first, untraced
    call at ``small`` warms what happens once per process (lazy imports, caches), which would not cancel."""
    run(small)()
    peaks = {n: peak_allocated(run(n)) for n in (small, large)}
    return (peaks[large] - peaks[small]) / (large - small)


def in_a_fresh_process(test: Callable) -> Callable:
    """Run the decorated test again, alone, in a new interpreter, and pass when it passes there.

    A stage runs in a process of its own; a test runs after whatever the suite ran before it in the same worker, and
    tracemalloc counts every allocation of the process: after the tensorboard + wandb training test, stage 02's
    finalize measured 1,286 bytes a row instead of 50, every time (what those libraries leave changes a code path
    the stage's own process never takes). The child measures and asserts; its output is printed here."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get(CHILD_ENV):
            return test(*args, **kwargs)
        nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]  # "tests/test_x.py::test_y (call)"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", nodeid],
                              cwd=Path(__file__).resolve().parents[1], env={**os.environ, CHILD_ENV: "1"},
                              capture_output=True, text=True)
        print(proc.stdout[-3000:])
        assert proc.returncode == 0, f"{nodeid} failed alone:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return run

