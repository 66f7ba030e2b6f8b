"""The terminal console every command prints through."""

from __future__ import annotations

from rich.console import Console


def default_console(record: bool = False) -> Console:
    """A terminal gets its own width; a pipe or CI log gets 120 columns instead of rich's 80,
    so tables stay readable in logs. ``record``: keep what is printed, for the run's log."""
    console = Console(record=record)
    return console if console.is_terminal else Console(width=120, record=record)
