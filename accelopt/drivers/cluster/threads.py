"""Short-lived work on reused threads: a rank's per-iteration receiving and posting threads.

Why: a parameter-server rank starts a few threads every iteration (a receiver per peer, a
poster per receive batch): ~2,300 thread starts in the default run's 280 iterations
(``strace -f -c``), each a ``clone3``, a new thread's stack and Python state, and a
handshake with the starting thread. :func:`start` hands the work to a thread that finished
earlier work instead, and starts a new thread only when none is idle (the default run's
makespan -0.47 s and wall time -0.9 s, paired medians of 8 rounds of
``benchmarks/startup.py``). Nothing is ever queued behind other work (the
pool has no bound), so work that blocks on the network, or on other such work, behaves as
on a thread of its own. One difference: thread-local state (torch's grad mode, autocast)
outlives a piece of work, so work must leave it as it found it (the receiving code changes
it only inside ``with`` blocks; the hook docs ask the same of plugins' hooks,
``accelopt/hookspecs.py``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

_idle: list[queue.SimpleQueue[Any]] = []
"""The inboxes of the threads waiting for work (``list.pop``/``append`` are atomic)."""
os.register_at_fork(after_in_child=_idle.clear)  # a forked child has none of these threads

_IDLE_S = 30.0
"""A thread that got no work for this long ends (a rank between runs holds none)."""


class Task:
    """One piece of work :func:`start` handed to a thread; :meth:`join` waits for its end."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = threading.Event()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the work has returned or raised; whether it has."""
        return self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


def start(fn: Callable[..., Any], *args: Any, name: str = "accelopt-work") -> Task:
    """Run ``fn(*args)`` on an idle thread of this process, or on a new daemon thread when
    none is idle. The work must handle its own exceptions (one that escapes is reported as
    an uncaught thread exception, ``threading.excepthook``, as on a thread of its own)."""
    task = Task()
    entry = (fn, args, name, task)
    try:
        inbox = _idle.pop()
    except IndexError:
        threading.Thread(target=_serve, args=(entry,), name=name, daemon=True).start()
    else:
        inbox.put(entry)
    return task


def _serve(entry: tuple[Callable[..., Any], tuple[Any, ...], str, Task]) -> None:
    """A reused thread's life: run its work, offer itself for more, end when idle too long."""
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    me = threading.current_thread()
    while True:
        fn, args, name, task = entry
        me.name = name
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - reported as a thread of its own's would be
            with contextlib.suppress(BaseException):
                threading.excepthook(threading.ExceptHookArgs((*sys.exc_info(), me)))
        del fn, args, entry  # hold nothing of finished work while idle
        _idle.append(inbox)  # before the work counts as done: whoever waited may reuse us
        task._done.set()
        del task
        try:
            entry = inbox.get(timeout=_IDLE_S)
        except queue.Empty:
            try:
                _idle.remove(inbox)
            except ValueError:  # taken just now: its work is on the way
                entry = inbox.get()
                continue
            return
