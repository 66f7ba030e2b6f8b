"""The terminal console every command prints through."""

from __future__ import annotations

from rich.console import Console


def default_console() -> Console:
    """A terminal gets its own width; a pipe or CI log gets 120 columns instead of rich's 80,
    so tables stay readable in logs."""
    console = Console()
    return console if console.is_terminal else Console(width=120)
