"""``accelopt.run``: the CLI's ``accelopt run`` as a Python function.

The same overrides, the same up-front validation (one :class:`~accelopt.errors.UserError`
naming the problem where the CLI prints one line and exits 2), the same run directory and
outputs, and the run's :class:`~accelopt.records.RunRecord` returned instead of printed:
a notebook or a sweep script gets the numbers without parsing ``metrics.json``.

    import accelopt
    record = accelopt.run(["+plugins=[salus]", "workload=tiny"])
    record.summary["makespan_s"], [j.status for j in record.jobs]

What differs from the CLI: Hydra's own ``.hydra/`` files are not written (the composed
config is, as ``config.yaml``), sweeps (``-m``) are not expanded (call ``run`` per point),
and the console output goes where ``console`` says (default: nowhere; ``accelopt.log`` in
the run directory keeps it, with the run's logged warnings and its error line, as the
CLI's does).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import random
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from accelopt.atomic import RUNS_DIR
from accelopt.errors import ConfigError
from accelopt.plugin import Registry
from accelopt.records import RunRecord

_F = TypeVar("_F", bound=Callable[..., Any])


def keeps_python_random(fn: _F) -> _F:
    """The caller's ``random`` state as it was when ``fn`` returns or raises. The first call
    in a process imports libraries that draw from it as they load (``rich.style`` takes 24
    bits), before a run could save any state: saved here, first thing."""

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        state = random.getstate()
        try:
            return fn(*args, **kwargs)
        finally:
            random.setstate(state)

    return kept  # type: ignore[return-value]


def check_run_arguments(call: str, run_dir: Any, registry: Any, console: Any) -> None:
    """Refuse a wrong type given for ``run_dir``, ``registry`` or ``console`` (shared by
    ``accelopt.run`` and ``accelopt.attach``) in one line naming it: each was used far from
    where it was given, and failed there with a raw AttributeError or TypeError (a string
    console even after the loop had trained, losing its report)."""
    from rich.console import Console

    expected = (("run_dir", run_dir, (str, os.PathLike), "a path (str or pathlib.Path)"),
                ("registry", registry, Registry, "an accelopt.plugin.Registry "
                 "(Registry.discover() for the installed plugins)"),
                ("console", console, Console, "a rich.console.Console"))
    for name, value, kinds, takes in expected:
        if value is not None and not isinstance(value, kinds):
            raise ConfigError(f"{call}: {name}= takes {takes} or None (the default), got "
                              f"{type(value).__name__} {value!r:.60}")


@keeps_python_random
def run(overrides: Sequence[str] = (), *, run_dir: str | Path | None = None,
        registry: Registry | None = None, console: Any = None) -> RunRecord:
    """Compose the config from ``overrides`` (as on the command line), validate it, run it
    and return its record; the outputs are in ``record.info.run_dir``.

    ``run_dir``: where the outputs go (default, as the CLI: ``runs/<date>/<time>`` under the
    working directory; ``hydra.run.dir=...`` among the overrides means the same). A
    directory that already holds a run's ``metrics.json`` is refused: results are never
    overwritten. ``registry``: the plugins to choose from (default: the installed ones;
    add your own with ``registry.add(spec)``). ``console``: a ``rich.console.Console`` for
    the run's tables and progress (default: discarded).

    The run trains under its own torch defaults whatever the caller set (default dtype
    float32, gradients enabled, even inside ``torch.no_grad()``) and leaves the caller's
    settings, threads and random states as they were; inside ``torch.inference_mode()``,
    which cannot be left from inside, it is refused."""
    from rich.console import Console

    from accelopt.cli.hydra_run import (
        drop_empty_plugin_selection,
        prepared_configs,
        refuse_bad_resume,
    )
    from accelopt.cli.run_dirs import refuse_taken_run_dir
    from accelopt.drivers.processes import (
        rank_server_started_early,
        refuse_unguarded_main,
        under_torchrun,
    )
    from accelopt.drivers.setup import refuse_inference_mode, torch_state_kept
    from accelopt.runtime.resume_target import run_mode
    from accelopt.runtime.run import execute

    refuse_inference_mode()  # before anything is composed or written
    check_run_arguments("accelopt.run", run_dir, registry, console)
    if isinstance(overrides, str):
        raise ConfigError(f"accelopt.run takes a list of overrides, got the string "
                          f"{overrides!r}; write accelopt.run([{overrides!r}])")
    args = drop_empty_plugin_selection([str(o) for o in overrides])
    if any(a in ("-m", "--multirun") for a in args):
        raise ConfigError("accelopt.run runs one configuration; for a sweep, call it once per "
                          "point (or use `accelopt run -m` from the shell)")
    named = [a for a in args if a.lstrip("+").startswith("hydra.run.dir=")]
    args = [a for a in args if a not in named]
    if named and run_dir is not None and Path(named[-1].split("=", 1)[1]) != Path(run_dir):
        raise ConfigError(f"accelopt.run: run_dir={str(run_dir)!r} and '{named[-1]}' name two "
                          "directories for one run; give one of them")
    if named and run_dir is None:
        run_dir = named[-1].split("=", 1)[1]
    registry = registry or Registry.discover()
    out = Path(run_dir) if run_dir is not None else default_run_dir()
    (cfg,) = prepared_configs(args, registry, run_dir=out)
    refuse_bad_resume([*args, f"hydra.run.dir={run_dir}"] if run_dir else args)
    refuse_taken_run_dir(out)
    mode = run_mode(cfg)  # a resume runs in its saved run's mode
    if mode != "none" and not under_torchrun():
        refuse_unguarded_main()
    console = console or Console(file=io.StringIO(), width=120)
    with rank_server_started_early({mode}), torch_state_kept(), run_logged(out, console):
        return execute(cfg, run_dir=out, registry=registry, console=console, overrides=args)


@contextlib.contextmanager
def run_logged(run_dir: Path, console: Any) -> Iterator[None]:
    """The run's ``accelopt.log``, as the command writes it: the warnings of accelopt's
    loggers as they happen (a watchdog naming a blocked hook), then what the run printed on
    ``console`` (its tables and ``warning:`` lines) and its error line. Only where the run
    kept its directory (its ``config.yaml``): a run refused before it started leaves none,
    as on the command line. A caller's console records the run's output for it and is left
    recording (or not) as it was, with what it had recorded before.

    A run stopped by Ctrl-C or SIGTERM raises its ``KeyboardInterrupt`` (``Terminated``)
    with the command's line as its message: where what ran is kept and how to continue it.
    Bare, it told a notebook's user nothing of the run directory (a default one named by the
    time), while the command printed that line."""
    from accelopt.cli.hydra_run import stopped_line, write_log
    from accelopt.drivers.cluster.launch import LOG_FORMAT
    from accelopt.runtime.resume_target import CONFIG_FILE
    from accelopt.runtime.run import error_line

    recording = bool(console.record)
    printed = _PrintedSince(console)
    console.record = True
    logger = logging.getLogger("accelopt")
    handler = _LogInRunDir(run_dir / "accelopt.log")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handlers: list[logging.Handler] = [handler]
    if not logger.hasHandlers() and logging.lastResort is not None:
        handlers.append(logging.lastResort)  # still on stderr, where they went without a log
    for each in handlers:
        logger.addHandler(each)
    error = ""
    try:
        yield
    except BaseException as exc:
        error = f"error: {error_line(exc)}"
        line = stopped_line(error_line(exc), run_dir) \
            if isinstance(exc, KeyboardInterrupt) and run_dir.is_dir() else ""
        if line:
            error = line  # the log ends with the line, as the command's does
            note = getattr(exc, "add_note", None)  # Python 3.11 on
            if not exc.args:  # as Ctrl-C and SIGTERM raise it
                exc.args = (line,)
            elif note is not None:
                note(line)
        raise
    finally:
        for each in handlers:
            logger.removeHandler(each)
        handler.close()
        if (run_dir / CONFIG_FILE).is_file():
            write_log(run_dir, printed, error)
        if not recording:
            console.export_text(clear=True)  # what this run made it record: not the caller's
        console.record = recording


class _PrintedSince:
    """What ``console`` printed from now on, as :func:`~accelopt.cli.hydra_run.write_log`
    reads it (``export_text``), leaving what it had recorded before in place."""

    def __init__(self, console: Any) -> None:
        self.console = console
        self.before = console.export_text(clear=False) if console.record else ""

    def export_text(self, clear: bool = True) -> str:
        text = self.console.export_text(clear=False)
        return text[len(self.before):] if text.startswith(self.before) else text


class _LogInRunDir(logging.FileHandler):
    """Appends to the run directory's log once the run made the directory (a warning logged
    before that, as the run is refused, has no log to go to)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is not None or Path(self.baseFilename).parent.is_dir():
            super().emit(record)


def default_run_dir(root: str | Path = RUNS_DIR) -> Path:
    """``runs/<YYYY-mm-dd>/<HH-MM-SS-ffffff>``, the CLI's pattern (``configs/config.yaml``)."""
    now = datetime.now()
    return Path(root) / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S-%f")
