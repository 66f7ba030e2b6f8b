"""Atomic file replacement shared by every writer (reports, configs, checkpoints).

A run can be interrupted (Ctrl-C, OOM kill) while it writes its outputs; writing to a temp
file in the same directory and ``os.replace``-ing it means a reader sees either the old
file or the complete new one, never half a file. Same directory, because ``os.replace`` is
only atomic within one filesystem.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO


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
def atomic_open(path: Path, mode: str = "w", *, durable: bool = True,
                **kwargs: object) -> Iterator[IO]:
    """Open a temp file next to ``path``; on success it replaces ``path``, on error it is
    deleted. ``mode`` is ``"w"`` (text, UTF-8 unless given) or ``"wb"``. ``durable=False``
    skips the fsync, for a scratch file that need not survive a crash of the machine."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        if "b" not in mode:
            kwargs.setdefault("encoding", "utf-8")
        with os.fdopen(fd, mode, **kwargs) as fh:  # type: ignore[call-overload]
            yield fh
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
