"""The terminal console every command prints through."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console


class TrimmedStdout:
    """What a console writes to a pipe or a file: ``sys.stdout`` as it is at each write (a
    command's :class:`~accelopt.cli.main.StdoutGuard` included), each line without the
    spaces rich pads it with (a table's centred title, a wrapped paragraph's last word), so
    ``accelopt run > log`` diffs and greps as the text it shows. A line is held until its
    newline (or a flush): only a whole line can be trimmed."""

    def __init__(self) -> None:
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            sys.stdout.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._partial:
            sys.stdout.write(self._partial)
            self._partial = ""
        sys.stdout.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(sys.stdout, "encoding", None) or "utf-8"

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stdout, name)


def trimmed(text: str) -> str:
    """``text`` (a console's recorded output) without spaces at the ends of its lines."""
    return "\n".join(line.rstrip(" ") for line in text.split("\n"))


def default_console(record: bool = False) -> Console:
    """A terminal gets its own width; a pipe or CI log gets 120 columns instead of rich's 80,
    so tables stay readable in logs, and lines without trailing spaces. ``record``: keep
    what is printed, for the run's log."""
    console = Console(record=record)
    if console.is_terminal:
        return console
    return Console(file=TrimmedStdout(), width=120, record=record)  # type: ignore[arg-type]
