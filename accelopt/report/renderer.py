"""Draw a run's ``timeline.png`` in a process of its own while the run writes its other
outputs.

Why: after the last job ends, the user waits for the jobs to be scored and the outputs to
be written on one core while the other is idle; matplotlib's import (~0.4 s on 2 cores) and
the drawing (~0.3 s for a cluster run's tens of thousands of spans) were part of that wait
(or, earlier, of the time before a cluster run forked its ranks). The run starts this
process as soon as its jobs have ended (a cluster run: when its leader has run the last
iteration, while the ranks still hand over their results), so the process imports
matplotlib while the run collects and scores the jobs, then receives the chart's layout
(:class:`TimelineLayout`, plain values) and draws while the run writes the metrics and the
trace. Not earlier: a process importing during the jobs, even at the lowest CPU priority,
was measured to lengthen the makespan on 2 cores about as much as it shortened the wait at
the end. A thread would not do: the drawing is Python work that holds the GIL.

Nothing depends on it: if the process cannot start, fails or times out, the run draws the
chart itself as before (:func:`accelopt.report.writer.write_run_outputs`), so the PNG is the
same either way. Where matplotlib is imported here already (a notebook, the test suite, an
all-reduce run's launcher, which imports it while its ranks' forkserver preloads dynamo:
``runtime/run.py``), drawing here costs no import and no process is started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from accelopt.report.timeline_png import TimelineLayout

DONE = "ok"
WAIT_S = 300.0
"""How long the run waits for the drawing before it draws the chart itself."""


class TimelineRenderer:
    """A drawing process: :meth:`start` it, :meth:`submit` one layout, :meth:`wait` for the
    PNG; :meth:`close` it in every case (it ends by itself when this process closes its
    input, so it never outlives the run)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process
        self._submitted = False
        self._layout_file: Path | None = None

    @classmethod
    def start(cls) -> TimelineRenderer | None:
        """Start the process; ``None`` if it cannot start."""
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "accelopt.report.renderer"], env=env, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError:
            return None
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The process's exit status once it has ended (``None`` while it runs)."""
        return self._process.poll()

    def submit(self, layout: TimelineLayout, path: Path) -> bool:
        """Hand the layout over; ``False`` if the process is gone already. The layout goes
        through a temporary file and the pipe carries one short line, so handing it over
        never waits on the process (a pipe's buffer is 64 KiB; a long run's layout is MBs)."""
        stdin, self._process.stdin = self._process.stdin, None  # ours to close, not Popen's
        if stdin is None:  # closed already
            return False
        fd, name = tempfile.mkstemp(prefix="accelopt-timeline-", suffix=".json")
        self._layout_file = Path(name)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(layout.to_json()))  # dumps: C encoder; dump streams in Python
        line = json.dumps({"path": str(Path(path).resolve()), "layout_file": name})
        try:
            stdin.write(line + "\n")
            stdin.close()
        except (OSError, ValueError):
            return False
        self._submitted = True
        return True

    def wait(self, timeout_s: float = WAIT_S) -> str | None:
        """``None`` once the PNG is written, else why it was not (the caller draws it)."""
        if not self._submitted:
            return "nothing was submitted"
        try:
            out, _ = self._process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            return f"the drawing process took over {timeout_s:g} s"
        except (OSError, ValueError) as exc:  # closed already
            return f"the drawing process is gone ({exc})"
        self._forget_layout()
        last = (out or "").strip().splitlines()[-1:] or [""]
        if self._process.returncode == 0 and last[0] == DONE:
            return None
        return last[0] or f"the drawing process exited with {self._process.returncode}"

    def close(self) -> None:
        """End the process if it still runs, and reap it (idempotent). Asked first (SIGTERM:
        a PNG half written is removed, ``atomic_open``), killed if still there 5 s later."""
        process = self._process
        stdin, process.stdin = process.stdin, None
        if stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                stdin.close()
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()
        self._forget_layout()

    def _forget_layout(self) -> None:
        if self._layout_file is not None:
            self._layout_file.unlink(missing_ok=True)
            self._layout_file = None


class DrawingProcess:
    """The drawing process of one run's outputs, started at most once: by :meth:`start` as
    soon as the jobs are known to have ended (a cluster's launcher learns it from its leader
    before the ranks have handed over their results: ``launch.run_cluster(when_jobs_end=)``,
    any thread), else on entering. ``with`` yields the :class:`TimelineRenderer` (``None``:
    the run draws its chart itself) and ends it on leaving, whatever happened; so does
    :meth:`close` for a run that fails before it gets there. None is started where
    matplotlib is imported in this process already: drawing here then costs no import."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._renderer: TimelineRenderer | None = None

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
            if "matplotlib.figure" not in sys.modules:
                self._renderer = TimelineRenderer.start()

    def close(self) -> None:
        with self._lock:
            self._started = True  # closed: never started after this
            renderer, self._renderer = self._renderer, None
        if renderer is not None:
            renderer.close()

    def __enter__(self) -> TimelineRenderer | None:
        self.start()
        return self._renderer

    def __exit__(self, *_exc: object) -> None:
        self.close()


def drawing_process() -> DrawingProcess:
    """A :class:`DrawingProcess` for the outputs written inside a ``with``."""
    return DrawingProcess()


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    """The drawing process: import matplotlib, wait for one layout on stdin, draw it, say
    ``ok`` on stdout (or the error's line). No input (the run ended otherwise): exit 0."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from accelopt.report.timeline_png import draw, import_matplotlib

    import_matplotlib()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    try:
        request = json.loads(line)
        handed = Path(request["layout_file"])
        layout = json.loads(handed.read_text(encoding="utf-8"))
        # read: the file has served, and the run may be gone without removing it (a bench
        # that stops its sweep, a killed run); the run's own removal tolerates this one
        handed.unlink(missing_ok=True)
        draw(TimelineLayout.from_json(layout), Path(request["path"]))
    except Exception as exc:  # noqa: BLE001 - reported to the run, which draws it itself
        print(f"{type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        return 1
    print(DONE, flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no teardown of matplotlib's modules: the run waits for this exit
