"""Atomic file replacement shared by every writer (reports, configs, checkpoints).

A run can be interrupted (Ctrl-C, OOM kill) while it writes its outputs; writing to a temp
file in the same directory and ``os.replace``-ing it means a reader sees either the old
file or the complete new one, never half a file. Same directory, because ``os.replace`` is
only atomic within one filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from accelopt.errors import AccelOptError, UserError

RUNS_DIR = "runs"
"""Where a run writes unless told otherwise, relative to the working directory
(``configs/config.yaml``'s ``hydra.run.dir`` and ``hydra.sweep.dir`` start with it)."""


WRITE_FAILURES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                            errno.EPERM, errno.EFBIG})
"""The errors of a write the machine refused (full disk, quota, read-only filesystem,
permission, an immutable directory): nothing the run did wrong, and nothing it can go on
writing its outputs through."""

UNWRITABLE_FIX = "free space there or make it writable, then run again"
"""What to do about an output the machine refused (:class:`OutputUnwritable`)."""


class OutputUnwritable(AccelOptError, OSError):
    """An output (a checkpoint, weights, a report file) the machine refused to write: one
    line naming the file, the OS's reason and what to do, exit 1, in every mode. Why its own
    error: torch reports a full disk as ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos`` with the ``OSError`` only chained, and a bare
    ``OSError`` reached the user as a traceback from whichever writer came first. Still an
    ``OSError`` (its ``errno``, ``strerror`` and ``filename`` are the cause's), so code that
    tolerates a failed write (``except OSError``) goes on tolerating it."""

    exit_code = 1

    def __init__(self, path: Path | str, cause: OSError) -> None:
        reason = cause.strerror or str(cause)
        OSError.__init__(self, cause.errno, reason, str(path))
        self.path = str(path)
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:  # a rank's error crosses a process boundary
        return (type(self), (self.path, OSError(self.errno, self.reason)))

    def __str__(self) -> str:
        return f"cannot write {self.path}: {self.reason}; {UNWRITABLE_FIX}"


def write_failure(exc: BaseException) -> OSError | None:
    """The refused write (an ``OSError`` in :data:`WRITE_FAILURES`) that ``exc`` is or was
    caused by, e.g. the ``OSError`` behind torch's ``RuntimeError``; ``None`` if none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in WRITE_FAILURES:
            return current
        current = current.__cause__ or current.__context__
    return None


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals whose Python handlers wait for an atomic write to end (Ctrl-C's
``KeyboardInterrupt``, SIGTERM's :class:`~accelopt.errors.Terminated`)."""

_deferring: list[bool] = []
"""Non-empty while :func:`interrupts_deferred` holds the handlers (nested writes do not
install them twice)."""


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then run the handlers they would have
    run (raising there). Why: an interrupt raised inside ``torch.save`` left its zip writer
    half done, and the writer's own clean-up then failed (``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``) while handling it: a traceback and exit 1, where
    a stop anywhere else is one line with the resume command, and no checkpoint at all. A
    write is short and bounded, so the stop waits for it, and the checkpoint it was writing
    is there to resume from. Only Python handlers are held (a signal whose handler is the
    system's default or ignored acts as before), only on the main thread (the only one
    Python runs handlers on, and the only one that may install them)."""
    if threading.current_thread() is not threading.main_thread() or _deferring:
        yield
        return
    pending: list[tuple[int, object]] = []

    def hold(signum: int, frame: object) -> None:
        pending.append((signum, frame))

    previous: dict[int, object] = {}
    _deferring.append(True)
    try:
        for signum in DEFERRED_SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler):
                previous[signum] = signal.signal(signum, hold)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        _deferring.clear()
        ran: set[int] = set()
        for signum, frame in pending:  # each signal's handler once, in the order they came
            if signum not in ran:
                ran.add(signum)
                previous[signum](signum, frame)  # type: ignore[operator]


def _interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt (Ctrl-C, :class:`~accelopt.errors.Terminated`) that ``exc`` was raised
    while handling, if any: torch's writer raises its own ``RuntimeError`` when an interrupt
    stops it mid-file, and the user asked for the stop, not for that error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, KeyboardInterrupt):
            return current
        current = current.__cause__ or current.__context__
    return None


def _create_temp(path: Path) -> tuple[int, Path]:
    """Create a hidden, unique temp file next to ``path``.

    Not ``tempfile.mkstemp``: that creates mode 0600, and outputs should get the usual
    permissions (0666 minus the umask) like any file the user writes.
    """
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", *, durable: bool = True, exclusive: bool = False,
                **kwargs: object) -> Iterator[IO]:
    """Open a temp file next to ``path``; on success it replaces ``path``, on error it is
    deleted; a write the machine refused (a full disk, a directory made read-only: in the
    chain of whatever the writer raised) is :class:`OutputUnwritable`. ``mode`` is ``"w"``
    (text, UTF-8 unless given) or ``"wb"``. ``durable=False`` skips the fsync, for a scratch
    file that need not survive a crash of the machine. ``exclusive``: ``path`` is created,
    never replaced (:func:`_put_exclusive`): ``FileExistsError`` where it is there already,
    the file left as it is (of two processes writing it at once, one wins).

    Ctrl-C and SIGTERM wait for the write to end (:func:`interrupts_deferred`), so a stop
    leaves the new file complete, then stops as anywhere else. An interrupt that still
    lands inside (a handler not held) deletes the temp file and is raised itself, never an
    error the writer raised while handling it."""
    with interrupts_deferred():
        with _atomic_open(path, mode, durable=durable, exclusive=exclusive,
                          **kwargs) as handle:
            yield handle


@contextlib.contextmanager
def _atomic_open(path: Path, mode: str, *, durable: bool, exclusive: bool,
                 **kwargs: object) -> Iterator[IO]:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(path)
    except OSError as exc:
        refused = write_failure(exc)
        if refused is None or isinstance(exc, OutputUnwritable):
            raise
        raise OutputUnwritable(path, refused) from exc
    try:
        if "b" not in mode:
            kwargs.setdefault("encoding", "utf-8")
        with os.fdopen(fd, mode, **kwargs) as fh:  # type: ignore[call-overload]
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        if exclusive:
            _put_exclusive(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        interrupt = _interrupt_behind(exc)
        if interrupt is not None and interrupt is not exc:
            raise interrupt from None
        refused = None if isinstance(exc, OutputUnwritable) else write_failure(exc)
        if refused is not None:
            raise OutputUnwritable(path, refused) from exc
        raise


def _put_exclusive(tmp: Path, path: Path) -> None:
    """Put the written ``tmp`` at ``path`` unless something is there. Why a link and not a
    look then a rename: two processes that both looked before either renamed both wrote,
    the second silently replacing the first. A link is created by one of them only, with
    the whole content at once; on a filesystem without hard links, ``path`` is taken with
    ``O_EXCL`` first (equally one winner), then replaced by the content."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:  # no hard links here
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.replace(tmp, path)
        return
    tmp.unlink()


def refuse_unwritable(target: Path, fix: str) -> None:
    """Raise a one-line :class:`UserError` unless a directory can be created at ``target``
    (or ``target`` is one this process can write into).

    Why a probe before any work: a read-only filesystem, a directory of another user or a
    path through a file otherwise surfaces as an ``OSError`` traceback from whichever writer
    comes first (Hydra's config dump, a run's metrics after it trained). The probe creates and
    removes one empty hidden directory in the nearest existing ancestor of ``target``; a
    permission check alone (``os.access``) says yes to root on a read-only mount point's
    parent and on ``/proc``."""
    ancestor = Path(target).expanduser().absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{target}: {ancestor} is a file, not a directory; {fix}")
    try:
        Path(tempfile.mkdtemp(prefix=".accelopt-writable-", dir=ancestor)).rmdir()
    except OSError as exc:
        raise UserError(f"cannot write {target} ({exc.strerror or exc}); {fix}") from None

