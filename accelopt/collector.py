"""Pausing Python's cyclic garbage collector over a burst of allocation that makes only live
objects.

Why: a process that has imported torch (and matplotlib, hydra) holds hundreds of thousands
of container objects, and every full collection scans all of them again. Unpickling the
ranks' results and building and writing a run's records allocate enough to set off two
such collections at the end of every cluster run (0.14 s each on 2 cores, where the user
waits for the outputs), although nothing they make is garbage. Paused for that phase, the
collector runs on its usual schedule afterwards, and nothing is left uncollected.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside, and on again on leaving if it was on (a caller that turned
    it off itself keeps it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
