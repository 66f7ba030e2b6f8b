"""Failure handling: a rank that dies (signal, exception, OOM) stops the whole run quickly,
with one line naming the rank, its pid, what killed it and the iteration it was in.

Children: :func:`die_with_parent` (the kernel SIGKILLs a child whose parent dies),
:func:`die_with_launcher` (a rank forked from the forkserver exits when the launcher dies),
:class:`Progress` (the current iteration in a tiny file the parent can read after a
SIGKILL) and :func:`write_failure` (the exception, before exiting). Parent:
:class:`Watchdog` polls the processes; on the first failure it waits a moment for the
other ranks' reports, picks the root cause (a signal death, else an ordinary exception,
else the earliest communication error, which is usually a consequence) and kills the rest.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing.connection
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelopt.errors import AccelOptError, RankFailed

PR_SET_PDEATHSIG = 1
GRACE_S = 1.0
KILL_WAIT_S = 3.0


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the thread that spawned it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass
    if os.getppid() == 1:  # parent already gone between fork and prctl
        os._exit(1)


def die_with_launcher(launcher_pid: int) -> None:
    """Exit when the launching process dies, whatever kills it.

    Why :func:`die_with_parent` is not enough: a rank forked from the forkserver has the
    forkserver as its parent, and a launcher killed by SIGKILL (the OOM killer, a CI
    runner's timeout) leaves the forkserver, and so its ranks, running on at full CPU. A
    daemon thread waits on a pidfd of the launcher (a poll once a second where there is
    none); when the launcher is gone it kills the forkserver (its work ended with the
    launcher) and exits."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(launcher_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while True:
                try:
                    os.kill(launcher_pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        parent = os.getppid()
        if parent not in (1, launcher_pid):  # the forkserver this run's launcher started
            try:
                os.kill(parent, signal.SIGKILL)
            except OSError:
                pass
        os._exit(1)

    threading.Thread(target=watch, name="accelopt-launcher-watch", daemon=True).start()


class Progress:
    """The iteration a rank is in, readable by the parent even after a SIGKILL."""

    def __init__(self, workdir: str | os.PathLike[str], rank: int) -> None:
        self.iteration: int | None = None
        self.path = Path(workdir) / f"progress-{rank}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def set(self, iteration: int) -> None:
        self.iteration = iteration
        os.pwrite(self._fd, f"{iteration:>12}".encode(), 0)

    @staticmethod
    def read(workdir: str | os.PathLike[str], rank: int) -> int | None:
        try:
            text = (Path(workdir) / f"progress-{rank}").read_text().strip()
            return int(text) if text else None
        except (OSError, ValueError):
            return None


ENDED_FILE = "ended.json"


def record_ended(workdir: str | os.PathLike[str], ended: dict[str, dict[str, Any]]) -> None:
    """The leader's record of the jobs that have ended (rewritten whole, atomically, at
    each job's end): if a later job stops the run, the launcher still knows which had
    finished, and their evidence says so instead of failing every job."""
    tmp = Path(workdir) / f".{ENDED_FILE}.tmp"
    tmp.write_text(json.dumps(ended))
    os.replace(tmp, Path(workdir) / ENDED_FILE)


def read_ended(workdir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    try:
        return dict(json.loads((Path(workdir) / ENDED_FILE).read_text()))
    except (OSError, ValueError):
        return {}


def is_communication_error(exc: BaseException) -> bool:
    from accelopt.drivers.cluster.transport import CommunicationError

    if isinstance(exc, CommunicationError):
        return True
    name = type(exc).__name__
    return name in ("DistBackendError", "DistNetworkError", "DistStoreError")


def write_failure(workdir: str | os.PathLike[str], rank: int, role: str,
                  iteration: int | None, exc: BaseException) -> None:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    note = {
        "rank": rank, "role": role, "pid": os.getpid(), "iteration": iteration,
        "error": f"{type(exc).__name__}: {text}" if text else type(exc).__name__,
        "communication": is_communication_error(exc), "time": time.time(),
        "exit_code": exc.exit_code if isinstance(exc, AccelOptError) else 1,
    }
    tmp = Path(workdir) / f".failure-{rank}.tmp"
    tmp.write_text(json.dumps(note))
    os.replace(tmp, Path(workdir) / f"failure-{rank}.json")


@dataclass
class Child:
    rank: int
    role: str
    process: Any  # multiprocessing.Process

    @property
    def pid(self) -> int | None:
        return self.process.pid


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Watchdog:
    """Watches the children of one run until all exit 0, or one fails."""

    def __init__(self, children: list[Child], workdir: str | os.PathLike[str],
                 poll_s: float = 0.05) -> None:
        self.children = children
        self.workdir = Path(workdir)
        self.poll_s = poll_s

    def wait(self) -> None:
        """Return when every child has exited 0; raise :class:`RankFailed` (the others
        killed) as soon as one exits otherwise. Wakes the moment a child exits (its
        process sentinel), so the run's results are read without a polling delay."""
        while True:
            codes = {c.rank: c.process.exitcode for c in self.children}
            if any(code not in (None, 0) for code in codes.values()):
                break
            if all(code == 0 for code in codes.values()):
                return
            running = [c.process.sentinel for c in self.children if c.process.exitcode is None]
            multiprocessing.connection.wait(running, timeout=1.0)
        error = self._diagnose()
        self.kill_all()
        raise error

    def _diagnose(self) -> RankFailed:
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:  # let the other ranks report what they saw
            if any(c.process.exitcode is not None and c.process.exitcode < 0
                   for c in self.children):
                break
            if all(c.process.exitcode is not None for c in self.children):
                break
            time.sleep(self.poll_s)
        candidates: list[tuple[tuple[int, float], RankFailed]] = []
        for c in self.children:
            code = c.process.exitcode
            if code is None or code == 0:
                continue
            note = self._note(c.rank)
            iteration = note.get("iteration") if note else Progress.read(self.workdir, c.rank)
            where = "before its first iteration" if iteration is None else f"at iteration {iteration}"
            if code < 0:
                sig = _signal_name(code)
                hint = " (out of memory? the OOM killer sends SIGKILL)" if sig == "SIGKILL" else ""
                msg = (f"rank {c.rank} ({c.role}, pid {c.pid}) was killed by {sig} {where}"
                       f"{hint}; the cluster run was stopped")
                candidates.append(((0, 0.0), RankFailed(msg, rank=c.rank, pid=c.pid,
                                                        iteration=iteration, cause=sig)))
            elif note:
                kind = 2 if note.get("communication") else 1
                msg = (f"rank {c.rank} ({c.role}, pid {c.pid}) raised {note['error']} {where}; "
                       "the cluster run was stopped")
                candidates.append(((kind, float(note.get("time", 0.0))),
                                   RankFailed(msg, rank=c.rank, pid=c.pid, iteration=iteration,
                                              cause=note["error"],
                                              exit_code=int(note.get("exit_code", 1)))))
            else:
                msg = (f"rank {c.rank} ({c.role}, pid {c.pid}) exited with code {code} {where}; "
                       "the cluster run was stopped")
                candidates.append(((3, 0.0), RankFailed(msg, rank=c.rank, pid=c.pid,
                                                        iteration=iteration, cause=f"exit {code}")))
        candidates.sort(key=lambda kv: kv[0])
        (kind, _), chosen = candidates[0]
        silent = [c for c in self.children if c.process.exitcode is None]
        if kind == 2 and silent:  # a peer timed out waiting: the one still alive may be why
            c = silent[0]
            at = Progress.read(self.workdir, c.rank)
            where = "before its first iteration" if at is None else f"at iteration {at}"
            chosen = RankFailed(
                f"{chosen}; rank {c.rank} ({c.role}, pid {c.pid}) had not exited when its peers "
                f"gave up, {where}: it may be the one they waited for (paused, stuck or "
                "overloaded)",
                rank=c.rank, pid=c.pid, iteration=at, cause="stopped responding",
                exit_code=chosen.exit_code)
        return chosen

    def _note(self, rank: int) -> dict[str, Any] | None:
        path = self.workdir / f"failure-{rank}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def kill_all(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after a few seconds, reap all."""
        for c in self.children:
            if c.process.exitcode is None and c.pid:
                _kill(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_WAIT_S
        for c in self.children:
            c.process.join(max(0.0, deadline - time.monotonic()))
        for c in self.children:
            if c.process.exitcode is None and c.pid:
                _kill(c.pid, signal.SIGKILL)
                c.process.join(5.0)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
