"""What a stage's row handling allocates per row, deterministically: the tracemalloc peak (Python objects and numpy
arrays; memory maps are not allocations) of the same call at two row counts. The constant part (a tokenizer, the
imports' caches) cancels in the difference; a structure that grows with the rows does not."""

from __future__ import annotations

import gc
import logging
import tracemalloc
from typing import Callable


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
