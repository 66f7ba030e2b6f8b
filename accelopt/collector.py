"""Pausing Python's cyclic garbage collector over a burst of allocation that makes only live
objects.

Why: a process that has imported torch (and matplotlib, hydra) holds hundreds of thousands
of container objects, and every full collection scans all of them again. Unpickling the
ranks' results and building and writing a run's records allocate enough to set off two
such collections at the end of every cluster run (0.14 s each on 2 cores, where the user
waits for the outputs), although nothing they make is garbage. Paused for that phase, the
collector runs on its usual schedule afterwards, and nothing is left uncollected.

The same holds for the ``accelopt run`` command's own start: Hydra, the config's
composition and torch's import make ~300,000 objects, none garbage, and set off four full
collections (~0.3 s on 2 cores) before a cluster run can fork its ranks. The command pauses
the collector from its first line (:func:`pause_until_run_starts`); the run, once it starts,
freezes what exists and turns the collector on again (:func:`run_starts`), as the ranks'
forkserver does after its imports (``drivers/rank_preload.py``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_paused_until_run_starts = False


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


def pause_until_run_starts() -> None:
    """The collector off until :func:`run_starts` (for a command that imports and composes
    before its run; never called by library code, whose callers own their collector)."""
    global _paused_until_run_starts
    if gc.isenabled():
        gc.disable()
        _paused_until_run_starts = True


def no_run_started() -> None:
    """A command that paused the collector (:func:`pause_until_run_starts`) ends without a
    run having started (a mistake refused first, ``accelopt run`` called in-process with
    ``execute`` replaced): the collector on again, nothing frozen. Left off, a caller in the
    same process (a notebook, a test session) ran on with no cyclic collection at all."""
    global _paused_until_run_starts
    if _paused_until_run_starts:
        _paused_until_run_starts = False
        gc.enable()


def run_starts() -> None:
    """If :func:`pause_until_run_starts` paused the collector: freeze every object made so far
    (imports and configuration, never garbage: no collection scans them again) and turn the
    collector on. Otherwise nothing."""
    global _paused_until_run_starts
    if _paused_until_run_starts:
        _paused_until_run_starts = False
        gc.freeze()
        gc.enable()
