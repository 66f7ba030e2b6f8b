"""Per-job progress bars for the terminal.

``advance`` is called once per training iteration from executor threads, so it must be
cheap and thread-safe. When bars are disabled (``--quiet``, output piped to a file, CI logs)
every method returns at once: a log file full of redraw escape codes helps nobody.
"""

from __future__ import annotations

import threading
from types import TracebackType

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

REFRESH_PER_SECOND = 4
"""Redraws happen on rich's own refresh thread at this rate, never inside ``advance``."""


class JobProgress:
    """One bar per job; a no-op when disabled or when the console is not a terminal."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[str, TaskID] = {}
        self._names: dict[str, str] = {}
        self._progress: Progress | None = None
        if enabled and console.is_terminal:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
                auto_refresh=True,
                refresh_per_second=REFRESH_PER_SECOND,
                transient=False,
            )

    @property
    def enabled(self) -> bool:
        return self._progress is not None

    def __enter__(self) -> JobProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def add_job(self, job_id: str, name: str, total: int) -> None:
        """Add a bar; adding the same job twice keeps the first bar."""
        progress = self._progress
        if progress is None:
            return
        with self._lock:
            if job_id in self._tasks:
                return
            self._names[job_id] = name
            self._tasks[job_id] = progress.add_task(escape(name), total=max(total, 0))

    def advance(self, job_id: str, n: int = 1) -> None:
        """Count ``n`` iterations; unknown jobs are ignored (never raise in the hot loop)."""
        progress = self._progress
        if progress is None:
            return
        task = self._tasks.get(job_id)
        if task is not None:
            # Progress.advance takes rich's own lock and does not redraw: cheap enough.
            progress.advance(task, n)

    def finish(self, job_id: str, status: str) -> None:
        """Mark the bar done (green tick) or anything else (red cross plus the status)."""
        progress = self._progress
        if progress is None:
            return
        with self._lock:
            task = self._tasks.get(job_id)
            name = escape(self._names.get(job_id, job_id))
        if task is None:
            return
        if status == "done":
            progress.update(task, description=f"[green]✓[/] {name}")
        else:
            progress.update(task, description=f"[bold red]✗ {name} ({escape(status)})[/]")
        progress.stop_task(task)
