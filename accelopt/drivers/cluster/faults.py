"""Failure handling: a rank that dies (signal, exception, OOM) stops the whole run quickly,
with one line naming the rank, its pid, what killed it and the iteration (and job) it was in.

Children: :func:`die_with_parent` (the kernel SIGKILLs a child whose parent dies),
:func:`die_with_launcher` (a rank forked from the forkserver exits when the launcher dies),
:class:`Progress` (the current iteration and job in a tiny file the parent can read
after a SIGKILL) and :func:`write_failure` (the exception, before exiting). Parent:
:class:`Watchdog` polls the processes; on the first failure it waits a moment for the
other ranks' reports, picks the root cause (the ranks' forkserver dying, a rendezvous port
already in use, a signal death, an ordinary exception, an exit without one, else the
earliest communication error, which is usually a consequence) and kills the rest. Under
torchrun there is no parent: :func:`torchrun_failure` gives each rank the same one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing.connection
import os
import re
import select
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from accelopt.atomic import OutputUnwritable, atomic_open
from accelopt.errors import (
    AccelOptError,
    JobsUnfinished,
    RankFailed,
    Terminated,
    UserError,
    error_text,
    first_line,
    raised_by_hook,
)

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


def sigterm_after(left: threading.Event, wait_s: float = GRACE_S) -> None:
    """A rank's SIGTERM waits up to ``wait_s`` for ``left`` (set once the rank has written
    its timeline so far, which its launcher asks for as the run stops), then ends the rank
    as SIGTERM does. Why: SIGTERM to the whole process group (what ``timeout`` and CI
    runners send) reached the ranks with the launcher, and a rank that died of it at once
    left nothing: the stopped run's trace.json was empty and its losses gone, where a
    SIGTERM to the launcher alone kept them. A rank signalled alone still dies of it (the
    launcher names "killed by SIGTERM"), ``wait_s`` later. Main thread only (a signal
    handler); the handler runs once the rank's main thread is back in Python, and where it
    is blocked in a transfer meanwhile, the writer thread leaves the timeline regardless."""

    def handler(signum: int, frame: Any) -> None:
        left.wait(wait_s)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, handler)


JOBS_ENDED = -1
"""The progress mark of a rank whose jobs have all ended."""


class At(NamedTuple):
    """Where a rank was: the iteration it was in, and whose (a cluster run's ranks run
    every job's iterations, so an iteration number alone does not say which job's code
    raised)."""

    iteration: int | None
    job_id: str = ""
    job_name: str = ""


_PROGRESS_BYTES = 512
"""A progress record's fixed size: the iteration, then the job as JSON, padded (one
``pwrite`` replaces the whole record, whatever the previous one held)."""


class Progress:
    """The iteration a rank is in, and its job, readable by the parent even after a
    SIGKILL."""

    def __init__(self, workdir: str | os.PathLike[str], rank: int) -> None:
        self.at = At(None)
        self.path = Path(workdir) / f"progress-{rank}"
        self.hooks_path = Path(workdir) / f"hooks-{rank}"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self._job: tuple[str, bytes] = ("", b"")
        """The last job's id and its encoded part of the record (made once per job, not
        per iteration)."""

    @property
    def iteration(self) -> int | None:
        return self.at.iteration

    def set(self, iteration: int, job_id: str = "", job_name: str = "") -> None:
        if job_id != self._job[0]:
            self._job = (job_id, _job_record(job_id, job_name))
        self.at = At(iteration, job_id, job_name)
        record = f"{iteration:>12} ".encode() + self._job[1]
        os.pwrite(self._fd, record.ljust(_PROGRESS_BYTES), 0)

    def hook_blocked(self, line: str) -> None:
        """Keep the hook watchdog's line (a plugin hook running for long) where the parent
        can read it: a rank stuck in a hook never raises, its peers time out, and the run's
        line must name the hook rather than guess (:meth:`Watchdog._diagnose`)."""
        with contextlib.suppress(OSError):  # a hint must never stop the rank
            with open(self.hooks_path, "a", encoding="utf-8") as fh:
                fh.write(line.replace("\n", " ") + "\n")

    @staticmethod
    def blocked_hooks(workdir: str | os.PathLike[str], rank: int) -> list[str]:
        """The hook calls rank ``rank``'s watchdog reported ("plugin 'x' has been in
        accelopt_transfer_done for 2.0 s"), oldest first."""
        try:
            lines = (Path(workdir) / f"hooks-{rank}").read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        return [_hook_clause(line) for line in lines if line.strip()]

    def jobs_ended(self) -> None:
        """Past the last iteration (the plugins report, the results are gathered): a failure
        now is not 'at iteration N', the last one this rank ran."""
        self.set(JOBS_ENDED)

    def served(self, job_id: str, iterations: int, service_s: float) -> None:
        """The leader's service time of the job it runs, over the iterations of it that it
        has finished, after each of them (one ``pwrite`` of a second fixed record, as
        :meth:`set`'s): a run stopped with its ranks (SIGTERM to the process group) leaves
        no worker's records, and the job's samples/s must divide the iterations counted
        by the time they took (:func:`read_ended`), not by the first iteration's alone,
        which is when the leader last wrote its record of a run of one job."""
        record = json.dumps([job_id, iterations, service_s]).encode()
        os.pwrite(self._fd, record.ljust(_PROGRESS_BYTES), _PROGRESS_BYTES)

    @staticmethod
    def read_served(workdir: str | os.PathLike[str], rank: int = 0) -> tuple[str, int, float] | None:
        """What :meth:`served` last wrote on rank ``rank`` (None: nothing, or not readable)."""
        try:
            with open(Path(workdir) / f"progress-{rank}", "rb") as fh:
                fh.seek(_PROGRESS_BYTES)
                job_id, iterations, service_s = json.loads(fh.read(_PROGRESS_BYTES).strip())
            return str(job_id), int(iterations), float(service_s)
        except (OSError, ValueError, TypeError):
            return None

    @staticmethod
    def read(workdir: str | os.PathLike[str], rank: int) -> int | None:
        return Progress.read_at(workdir, rank).iteration

    @staticmethod
    def read_at(workdir: str | os.PathLike[str], rank: int) -> At:
        """Where rank ``rank`` last said it was (``At(None)``: before its first iteration)."""
        try:
            with open(Path(workdir) / f"progress-{rank}", "rb") as fh:
                text = fh.read(_PROGRESS_BYTES).decode()
            number, _, job = text.strip().partition(" ")
            iteration = int(number)
        except (OSError, ValueError):
            return At(None)
        try:
            job_id, job_name = json.loads(job)
            return At(iteration, str(job_id), str(job_name))
        except (ValueError, TypeError):
            return At(iteration)


_HOOK_LINE = re.compile(r"(plugin '.*?' has been in \w+ for [\d.]+ s)")


def _hook_clause(line: str) -> str:
    """The watchdog's line without its rank prefix and its thread and file: "plugin 'x'
    has been in accelopt_transfer_done for 2.0 s"."""
    found = _HOOK_LINE.search(line)
    return found.group(1) if found else line.strip()


def reached(workdir: str | os.PathLike[str], exc: BaseException) -> int | None:
    """The iteration the run's current job had reached when ``exc`` stopped it: the failing
    rank's, or, stopped from outside (Ctrl-C, SIGTERM), the leader's (rank 0: every rank
    runs the same iteration of the same job, give or take one). None: before the first
    iteration, or after the last."""
    iteration = exc.iteration if isinstance(exc, RankFailed) else Progress.read(workdir, 0)
    return None if iteration is None or iteration == JOBS_ENDED else iteration


def _job_record(job_id: str, job_name: str) -> bytes:
    """A job's part of a progress record, within its fixed size: the name left out, then
    the id too, where they are too long for it (the iteration is always kept)."""
    for parts in ([job_id, job_name], [job_id, ""], ["", ""]):
        record = json.dumps(parts).encode()
        if len(record) <= _PROGRESS_BYTES - 13:
            return record
    return b""


ENDED_FILE = "ended.json"


def record_ended(workdir: str | os.PathLike[str], ended: dict[str, dict[str, Any]]) -> None:
    """The leader's record of the jobs that have ended (rewritten whole, atomically, at
    each job's end): if a later job stops the run, the launcher still knows which had
    finished, and their evidence says so instead of failing every job. A temp file of its
    own per write: one fixed name, renamed by one writer, was gone for the other."""
    with atomic_open(Path(workdir) / ENDED_FILE, durable=False) as fh:
        fh.write(json.dumps(ended))


def read_ended(workdir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """The leader's record of the jobs (:func:`record_ended`), the job it was running
    brought up to the iterations it had finished and their service time
    (:meth:`Progress.served`): its record is written when it starts, so without this a
    run stopped later paired the iterations reached with the first iteration's service
    time, and its samples/s was many times the real one."""
    try:
        ended = dict(json.loads((Path(workdir) / ENDED_FILE).read_text()))
    except (OSError, ValueError):
        return {}
    served = Progress.read_served(workdir, 0)
    if served is None:
        return ended
    job_id, iterations, service_s = served
    mine = ended.get(job_id)
    if (mine is not None and mine.get("status") == "running"
            and iterations >= int(mine.get("iterations") or 0)):
        mine.update(iterations=iterations, service_s=service_s)
    return ended


_GLOO_PEER_ERROR = re.compile(
    r"gloo/transport/|Timed out waiting \d+ms for (send|recv)|Connection (closed|reset) by peer")
"""What gloo's errors about a peer say: outside accelopt's transport (a collective before
the first iteration, a process group's set-up) they come as a plain ``RuntimeError``."""
_PORT_IN_USE = re.compile(r"port: (\d+).*EADDRINUSE", re.DOTALL)


def port_in_use(exc: BaseException) -> int | None:
    """The port a rendezvous store could not listen on because something else does
    (torch's ``DistNetworkError`` says ``port: N ... EADDRINUSE``), else None."""
    found = _PORT_IN_USE.search(str(exc))
    return int(found.group(1)) if found else None


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` is about a peer (it went away, or did not answer in time): usually a
    consequence of another rank's failure, so the root cause is looked for elsewhere. A port
    already in use is not: it is this rank's own (configuration) problem."""
    from accelopt.drivers.cluster.transport import CommunicationError

    if isinstance(exc, CommunicationError):
        return True
    if port_in_use(exc) is not None:
        return False
    if type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError"):
        return True
    return isinstance(exc, RuntimeError) and bool(_GLOO_PEER_ERROR.search(str(exc)))


def rank_error_text(exc: BaseException) -> str:
    """How a rank's error appears in the run's line: ``Type: first line``, with what the
    rank added about it (``accelopt_context``: a worker's rows of the batch)."""
    return error_text(exc) + getattr(exc, "accelopt_context", "")


def where(iteration: int | None, job_name: str = "") -> str:
    if iteration == JOBS_ENDED:
        return "after its jobs ended"
    if iteration is None:
        return "before its first iteration"
    return f"at iteration {iteration}" + (f" of job '{job_name}'" if job_name else "")


_NAMED_ITERATION = re.compile(r" at iteration (\d+)\b")
"""How the transport's errors name the iteration of the transfer that failed."""


def raised_line(rank: int, role: str, pid: int | None, error: str,
                iteration: int | None, job_name: str = "") -> str:
    """The run's one line for a rank that raised (the local launcher's and torchrun's). An
    error that says its iteration itself (the transport's timeouts do) has that phrase
    taken out and the line says that iteration, once, with the job. Why the error's and
    not the rank's progress: a PS worker receives the next iteration's parameters while its
    progress still says the last one, and the line read "receiving from rank 0 at
    iteration 3: ... at iteration 2" (the iteration the transfer was for is the one that
    failed)."""
    named = _NAMED_ITERATION.search(error)
    if named is not None and iteration != JOBS_ENDED:
        error = error[:named.start()] + error[named.end():]
        iteration = int(named.group(1))
    return (f"rank {rank} ({role}, pid {pid}) raised {error} {where(iteration, job_name)}; "
            "the cluster run was stopped")


def user_error_line(rank: int, role: str, message: str, iteration: int | None,
                    job_name: str = "") -> str:
    """The run's one line for a rank whose input was wrong (a :class:`UserError` found once
    training ran, such as a parameter all-reduce never gets a gradient for): the problem and
    its fix first, as every other user error reads, then where the rank was. The job is not
    named twice when the message already starts with it."""
    named = bool(job_name) and message.startswith(f"job '{job_name}'")
    return (f"{message} (rank {rank}, {role}, {where(iteration, '' if named else job_name)}; "
            "the cluster run was stopped)")


def note_line(note: dict[str, Any], iteration: int | None, job_name: str = "") -> str:
    """The run's line for a rank's failure note (its own, or a peer's read from the store)."""
    if note.get("user_error"):
        return user_error_line(note["rank"], note["role"], note["message"], iteration, job_name)
    return raised_line(note["rank"], note["role"], note["pid"], note["error"], iteration,
                       job_name)


def port_in_use_line(port: int, setting: str, fix: str) -> str:
    """A rendezvous port something else listens on: the port and the fix."""
    return f"the rendezvous port {port} ({setting}) is already in use by another process; {fix}"


LOCAL_PORT_FIX = "set cluster.master_port=0 to pick a free port, or choose another"


def failure_note(rank: int, role: str, at: At, exc: BaseException) -> dict[str, Any]:
    """What a failing rank tells the others: who it is, where it was and what it raised.
    ``culprit``: the job whose own code raised (its model, data or loss), which a
    one-process run would fail alone; not a plugin's hook, whose error stops the run
    whichever job's iteration it was in."""
    own = not raised_by_hook(exc) and not isinstance(exc, Terminated)
    # a job's own error exits as in one process, where that job fails alone and the run
    # ends with 3 (some jobs failed, outputs written): here it stops the run, as every rank
    # runs every job, and the exit code says the same (not 1, "a plugin or accelopt")
    # a refused write (a full disk) is no job's failure: exit 1, as in one process
    if (own and at.job_id and not is_communication_error(exc)
            and not isinstance(exc, OutputUnwritable)):
        exit_code = JobsUnfinished.exit_code
    else:
        exit_code = exc.exit_code if isinstance(exc, AccelOptError) else 1
    return {
        "rank": rank, "role": role, "pid": os.getpid(), "iteration": at.iteration,
        "job_id": at.job_id, "job_name": at.job_name, "culprit": at.job_id if own else "",
        "error": rank_error_text(exc), "user_error": isinstance(exc, UserError),
        "message": first_line(exc),
        "port_in_use": port_in_use(exc),
        "communication": is_communication_error(exc), "time": time.time(),
        "exit_code": exit_code,
    }


def write_failure(workdir: str | os.PathLike[str], rank: int, role: str, at: At,
                  exc: BaseException) -> None:
    note = failure_note(rank, role, at, exc)
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


SIGNAL, EXCEPTION, EXIT, COMMUNICATION = 0, 1, 2, 3
"""The order in which a failed rank is taken as the run's root cause."""
FORKSERVER_LOST = 255
"""The exit code multiprocessing gives a forkserver child whose status it cannot read."""


def _forkserver_pid(children: list[Child]) -> int | None:
    """The pid of the forkserver the children were forked from (None: they were not)."""
    popen = getattr(children[0].process, "_popen", None) if children else None
    if not type(popen).__module__.endswith("popen_forkserver"):
        return None
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None)


def process_gone(pid: int, wait_s: float = 0.0) -> bool:
    """Whether process ``pid`` has exited (a zombie counts: this process has not reaped
    it, and must not, multiprocessing does), waiting up to ``wait_s`` for it to finish."""
    deadline = time.monotonic() + wait_s
    while True:
        if not Path("/proc/self").exists():  # no procfs: alive until it cannot be signalled
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
            return False
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


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
        """Return when every child has exited 0; raise :class:`RankFailed` as soon as one
        exits otherwise. The others are left running: the caller asks them for what they
        have (their timelines so far), then :meth:`kill_all`. Wakes the moment a child
        exits (its process sentinel), so the run's results are read without a polling
        delay."""
        while True:
            codes = {c.rank: c.process.exitcode for c in self.children}
            if any(code not in (None, 0) for code in codes.values()):
                break
            if all(code == 0 for code in codes.values()):
                return
            running = [c.process.sentinel for c in self.children if c.process.exitcode is None]
            multiprocessing.connection.wait(running, timeout=1.0)
        raise self._diagnose()

    def _diagnose(self) -> RankFailed:
        """The root cause among the ranks that exited: each is ranked by :meth:`_candidate`
        (lowest first; among communication errors, the earliest)."""
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:  # let the other ranks report what they saw
            if any(c.process.exitcode is not None and c.process.exitcode < 0
                   for c in self.children):
                break
            if all(c.process.exitcode is not None for c in self.children):
                break
            time.sleep(self.poll_s)
        server = self._dead_forkserver()
        if server is not None:
            return server
        candidates = [self._candidate(c) for c in self.children
                      if c.process.exitcode not in (None, 0)]
        candidates.sort(key=lambda kv: kv[0])
        (kind, _), chosen = candidates[0]
        silent = [c for c in self.children if c.process.exitcode is None]
        if kind == COMMUNICATION:
            hooked = self._blocked_hook(silent or self.children)
            if hooked is not None:
                return hooked(chosen)
        if kind == COMMUNICATION and silent:  # a peer timed out waiting: the one alive may be why
            c = silent[0]
            at = Progress.read_at(self.workdir, c.rank)
            chosen = RankFailed(
                f"{chosen}; rank {c.rank} ({c.role}, pid {c.pid}) had not exited when its peers "
                f"gave up, {where(at.iteration, at.job_name)}: it may be the one they waited for "
                "(paused, stuck or overloaded)",
                rank=c.rank, pid=c.pid, iteration=at.iteration, cause="stopped responding",
                exit_code=chosen.exit_code)  # stuck in whose code, nobody can tell
        return chosen

    def _blocked_hook(self, children: list[Child]) -> Any:
        """Where a rank's hook watchdog saw a plugin hook run for long (the first such rank
        among ``children``), what turns a peer's communication error into the run's line
        naming that hook; else None. Why: the line blamed the peer's timeout and guessed
        that the silent rank "may be the one", while the watchdog had named the hook."""
        for c in children:
            hooks = Progress.blocked_hooks(self.workdir, c.rank)
            if not hooks:
                continue
            at = Progress.read_at(self.workdir, c.rank)

            def line(chosen: RankFailed, c: Child = c, hooks: list[str] = hooks,
                     at: At = at) -> RankFailed:
                return RankFailed(
                    f"rank {c.rank} ({c.role}, pid {c.pid}) was stuck in a plugin hook "
                    f"{where(at.iteration, at.job_name)}: {hooks[-1]} (hook watchdog), and its "
                    f"peers gave up waiting: {chosen}",
                    rank=c.rank, pid=c.pid, iteration=at.iteration,
                    cause=f"stuck in a plugin hook: {hooks[-1]}", exit_code=chosen.exit_code)

            return line
        return None

    def _candidate(self, c: Child) -> tuple[tuple[int, float], RankFailed]:
        """How likely a rank that exited non-zero is the root cause (its rank in the order
        signal, port in use, exception, exit without one, communication error) and its line.
        A rank that exits non-zero without a Python exception (``os._exit``, a native
        ``exit()``) comes before the communication errors of its peers: "connection reset by
        peer" is what they see of it."""
        code = int(c.process.exitcode)
        note = self._note(c.rank)
        at = (At(note.get("iteration"), note.get("job_id") or "", note.get("job_name") or "")
              if note else Progress.read_at(self.workdir, c.rank))
        iteration, job_id = at.iteration, note.get("culprit", "") if note else at.job_id
        where_ = where(iteration, at.job_name)
        if code < 0:
            sig = _signal_name(code)
            hint = " (out of memory? the OOM killer sends SIGKILL)" if sig == "SIGKILL" else ""
            msg = (f"rank {c.rank} ({c.role}, pid {c.pid}) was killed by {sig} {where_}"
                   f"{hint}; the cluster run was stopped")
            # the jobs did not finish (a dead worker), not a plugin's or accelopt's error: 3
            return (SIGNAL, 0.0), RankFailed(msg, rank=c.rank, pid=c.pid, iteration=iteration,
                                             cause=sig, job_id=job_id,
                                             exit_code=JobsUnfinished.exit_code)
        if note and note.get("port_in_use") is not None:
            msg = port_in_use_line(int(note["port_in_use"]), "cluster.master_port",
                                   LOCAL_PORT_FIX)
            return (SIGNAL, 0.0), RankFailed(msg, rank=c.rank, pid=c.pid, iteration=iteration,
                                             cause="port in use", exit_code=2)
        if note:
            kind = COMMUNICATION if note.get("communication") else EXCEPTION
            msg = note_line({**note, "rank": c.rank, "role": c.role, "pid": c.pid}, iteration,
                            at.job_name)
            return (kind, float(note.get("time", 0.0))), RankFailed(
                msg, rank=c.rank, pid=c.pid, iteration=iteration, cause=note["error"],
                exit_code=int(note.get("exit_code", 1)),
                job_id="" if kind == COMMUNICATION else job_id)
        # no note: the rank raised no Python error (os._exit, native code's exit()), so no
        # traceback above says why; its job did not finish, as a killed rank's: exit code 3
        msg = (f"rank {c.rank} ({c.role}, pid {c.pid}) exited with code {code} {where_} "
               "without reporting a Python error (os._exit, or native code's exit(); what it "
               "wrote to stderr, if anything, is above); the cluster run was stopped")
        return (EXIT, 0.0), RankFailed(msg, rank=c.rank, pid=c.pid, iteration=iteration,
                                       cause=f"exit {code}", job_id=job_id,
                                       exit_code=JobsUnfinished.exit_code)

    def _dead_forkserver(self) -> RankFailed | None:
        """The ranks' forkserver (their parent) died, and the ranks with it (parent-death
        signal): multiprocessing then reports each rank's exit code as 255, a placeholder
        for the status it could no longer read, which said "rank 0 exited with code 255"."""
        if not any(c.process.exitcode == FORKSERVER_LOST and self._note(c.rank) is None
                   for c in self.children):
            return None
        pid = _forkserver_pid(self.children)
        if pid is None or not process_gone(pid, wait_s=GRACE_S):
            return None
        seen = [a for c in self.children
                if (a := Progress.read_at(self.workdir, c.rank)).iteration is not None]
        # the furthest rank's iteration, and its job: named as a rank's own death names it
        at = max(seen, key=lambda a: a.iteration or 0) if seen else At(None)
        first = self.children[0]
        # every rank died (its jobs unfinished), as a killed rank's do: the same exit code 3
        return RankFailed(
            f"the ranks' forkserver (their parent process, pid {pid}) died "
            f"{where(at.iteration, at.job_name)}, and every rank with it (killed? the OOM "
            "killer can pick it too); the cluster run was stopped", rank=first.rank, pid=pid,
            iteration=at.iteration, cause="forkserver died",
            exit_code=JobsUnfinished.exit_code)

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


# Under torchrun (or any RANK/WORLD_SIZE/MASTER_ADDR launch) there is no watchdog: each rank
# is its own top-level process and torchrun SIGTERMs the others when one exits. Each rank
# therefore turns its own failure into the run's one line, and a failing rank leaves its note
# in the process group's store, where rank 0 (which writes the run's outputs) reads it.

FAILURE_KEY = "accelopt-failure-{rank}"


def _default_store() -> Any | None:
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def publish_failure(note: dict[str, Any]) -> None:
    """Leave this rank's failure note in the group's store (best effort: the store may be
    gone with the rank that hosted it)."""
    try:
        store = _default_store()
        if store is not None:
            store.set(FAILURE_KEY.format(rank=note["rank"]), json.dumps(note))
    except Exception:  # noqa: BLE001 - the rank's own error is the one to report
        pass


def peer_failure(rank: int, world: int, wait_s: float) -> dict[str, Any] | None:
    """Another rank's failure note from the group's store, waiting up to ``wait_s`` for one;
    an ordinary exception before a communication error, then the earliest."""
    try:
        store = _default_store()
    except Exception:  # noqa: BLE001
        store = None
    if store is None:
        return None
    keys = {r: FAILURE_KEY.format(rank=r) for r in range(world) if r != rank}
    deadline = time.monotonic() + wait_s
    notes: list[dict[str, Any]] = []
    while True:
        try:
            notes = [json.loads(store.get(k)) for k in keys.values() if store.check([k])]
        except Exception:  # noqa: BLE001 - the store went away: nobody left to ask
            return None
        if notes or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    notes.sort(key=lambda n: (bool(n.get("communication")), float(n.get("time", 0.0))))
    return notes[0] if notes else None


PEER_FAILED = "a peer rank failed or stopped (see that rank's output)"


def torchrun_failure(exc: BaseException, *, rank: int, world: int, role: str,
                     at: At) -> BaseException:
    """The error a torchrun rank raises for ``exc`` (one line, as the local launcher's
    watchdog gives): its own exception, named with rank, role, pid and iteration (and left
    for the others in the store); a peer's failure as that peer's line where it left one,
    else "a peer rank failed or stopped"; a rendezvous that failed names MASTER_ADDR and
    MASTER_PORT. A :class:`UserError` (bad input, found on every rank alike) stays itself."""
    pid = os.getpid()
    joining = (is_communication_error(exc) or isinstance(exc, TimeoutError)
               or port_in_use(exc) is not None)
    if joining and _default_store() is None:  # not in the process group yet
        return rendezvous_failure(exc, rank)
    iteration = at.iteration
    note = failure_note(rank, role, at, exc)
    own = not isinstance(exc, Terminated) and not note["communication"]
    if own:
        publish_failure(note)
        if isinstance(exc, UserError):
            return exc
        return RankFailed(raised_line(rank, role, pid, note["error"], iteration, at.job_name),
                          rank=rank, pid=pid, iteration=iteration, cause=note["error"],
                          exit_code=int(note["exit_code"]), job_id=note["culprit"])
    peer = peer_failure(rank, world, GRACE_S)
    if peer is not None:
        line = note_line(peer, peer["iteration"], peer.get("job_name") or "")
        return RankFailed(line, rank=peer["rank"], pid=peer["pid"], iteration=peer["iteration"],
                          cause=peer["error"], exit_code=int(peer.get("exit_code", 1)),
                          job_id=peer.get("culprit") or "")
    if isinstance(exc, Terminated):
        return RankFailed(f"rank {rank} ({role}, pid {pid}) was terminated (SIGTERM) "
                          f"{where(iteration, at.job_name)}; torchrun stops its ranks so "
                          "when it was itself interrupted or terminated (Ctrl-C, kill) or when "
                          "a peer rank failed (that rank's output then says why)",
                          rank=rank, pid=pid, iteration=iteration, cause="SIGTERM",
                          exit_code=Terminated.exit_code)
    return RankFailed(f"rank {rank} ({role}, pid {pid}) lost its peers "
                      f"{where(iteration, at.job_name)} "
                      f"({note['error']}): {PEER_FAILED}", rank=rank, pid=pid,
                      iteration=iteration, cause=note["error"])


def rendezvous_failure(exc: BaseException, rank: int) -> RankFailed:
    """A rank that could not join its process group: the address and port it was given
    are what to check (every rank must have the same, and reach it)."""
    addr = os.environ.get("MASTER_ADDR", "?")
    port = os.environ.get("MASTER_PORT", "?")
    taken = port_in_use(exc)
    if taken is not None:
        return RankFailed(port_in_use_line(taken, "MASTER_PORT", "give torchrun another "
                                           "--master-port, or stop what listens on it"),
                          rank=rank, pid=os.getpid(), iteration=None, cause="port in use",
                          exit_code=2)
    return RankFailed(
        f"rank {rank} could not join the other ranks through MASTER_ADDR={addr} "
        f"MASTER_PORT={port} ({error_text(exc)}); check that every rank was given the same "
        "MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and can reach that address and port",
        rank=rank, pid=os.getpid(), iteration=None, cause=error_text(exc))
