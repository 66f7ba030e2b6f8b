"""Says, in one line, when a plugin's hook has been running for a long time.

Why: a hook runs on the thread of the work it belongs to (a lane, a rank's step, a
transport's receiving thread), so a hook that blocks (a lock it never gets, an input it
waits for, a remote call) stalls that work with nothing on the screen: the progress bar
stops, and nobody is named. The watchdog names the plugin, the hook and the thread.

How, at no cost to the hook path: a daemon thread looks at every thread's Python stack
every ``interval_s`` seconds (``sys._current_frames``) for a frame whose code is a plugin's
hook implementation. A call is the same call on the next look when it is the same frame
object (the watchdog keeps the frames it is watching, so a finished call's frame is never
confused with a new one at the same address). A call seen for ``after_s`` seconds or more is
reported once, as a warning of the ``accelopt.watchdog`` logger (the console and the run's
``accelopt.log``). Nothing is stopped: the hook may be slow on purpose.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType, TracebackType

log = logging.getLogger("accelopt.watchdog")

Owners = Callable[[], Mapping[object, str]]
"""The code of every hook implementation of the process, with the plugin that owns it."""


class HookWatchdog:
    """Reports a plugin hook call that has run for ``after_s`` seconds or more."""

    def __init__(self, owners: Owners, after_s: float = 60.0, *, interval_s: float | None = None,
                 where: str = "", say: Callable[[str], None] = log.warning,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``where``: the process, for the line (a cluster rank: ``"rank 1 (worker): "``)."""
        if after_s <= 0:
            raise ValueError(f"after_s must be > 0, got {after_s}")
        self.owners = owners
        self.after_s = after_s
        self.interval_s = interval_s if interval_s is not None else min(1.0, after_s / 4)
        self.where = where
        self.say = say
        self.clock = clock
        self.reported: list[str] = []
        """Every line said, in order."""
        self._watched: dict[int, tuple[FrameType, float, bool]] = {}
        """id(frame) -> (the frame, when it was first seen, whether it was reported)."""
        self._plugin: dict[int, str] = {}
        """id(frame) -> the plugin whose hook it runs (for :meth:`in_flight`)."""
        self._looking = threading.Lock()
        """The watchdog's thread and :meth:`in_flight` (a failing rank) may look at once."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def look(self) -> None:
        """One look at every thread's stack (what the watchdog's thread does each interval)."""
        with self._looking:
            self._look()

    def _look(self) -> None:
        owners = self.owners()
        now = self.clock()
        names = {t.ident: t.name for t in threading.enumerate()}
        seen: dict[int, tuple[FrameType, float, bool]] = {}
        for ident, top in sys._current_frames().items():
            frame: FrameType | None = top
            while frame is not None:
                plugin = owners.get(frame.f_code)
                if plugin is not None:
                    seen[id(frame)] = self._watch(frame, plugin, now, names.get(ident, "?"))
                    self._plugin[id(frame)] = plugin
                frame = frame.f_back
        self._watched = seen  # calls that ended are let go
        self._plugin = {key: self._plugin[key] for key in seen}

    def _watch(self, frame: FrameType, plugin: str, now: float,
               thread: str) -> tuple[FrameType, float, bool]:
        known = self._watched.get(id(frame))
        first, said = (known[1], known[2]) if known is not None and known[0] is frame else (now, False)
        if not said and now - first >= self.after_s:
            took = now - first
            line = (f"{self.where}plugin '{plugin}' has been in {frame.f_code.co_name} for "
                    f"{took:.{0 if took >= 10 else 1}f} s (thread {thread}, {frame.f_code.co_filename}:"
                    f"{frame.f_lineno}); a hook that blocks stalls the work it runs in")
            self.reported.append(line)
            self.say(line)
            said = True
        return frame, first, said

    def in_flight(self) -> str:
        """The reported hook calls still running, as a clause for an error line ("; plugin
        'x' had been in accelopt_transfer_done for at least 5.1 s (hook watchdog)"), or
        ``""``. Why: a rank that fails because a hook blocked (its peers' transfers timed
        out) would otherwise end with a timeout that names no plugin; the warning said it,
        the error line did not."""
        with self._looking:
            self._look()
            now = self.clock()
            calls = [(frame.f_code.co_name, self._plugin.get(key, "?"), now - first)
                     for key, (frame, first, said) in self._watched.items() if said]
        return "".join(f"; plugin '{plugin}' had been in {hook} for at least {took:.1f} s "
                       "(hook watchdog)" for hook, plugin, took in calls)

    # -- the thread ----------------------------------------------------------------------

    def start(self) -> HookWatchdog:
        self._thread = threading.Thread(target=self._run, name="accelopt-watchdog", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.look()
            except Exception as exc:  # noqa: BLE001 - a watchdog must never stop a run
                log.debug("hook watchdog: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._watched, self._plugin = {}, {}  # no frame (and its locals) kept past the run

    def __enter__(self) -> HookWatchdog:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def watching(owners: Owners, after_s: float,
             where: str = "") -> contextlib.AbstractContextManager[object]:
    """A watchdog over the hooks ``owners`` lists for a ``with`` block, or nothing when
    ``after_s`` is 0 or less (``run.hook_watchdog_s=0``)."""
    return HookWatchdog(owners, after_s, where=where) if after_s > 0 else contextlib.nullcontext()
