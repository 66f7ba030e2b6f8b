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
and the console output goes where ``console`` says (default: nowhere).
"""

from __future__ import annotations

import functools
import io
import random
from collections.abc import Callable, Sequence
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
    the run's tables and progress (default: discarded)."""
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
    from accelopt.drivers.setup import torch_state_kept
    from accelopt.runtime.resume_target import run_mode
    from accelopt.runtime.run import execute

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
    with rank_server_started_early({mode}), torch_state_kept():
        return execute(cfg, run_dir=out, registry=registry, console=console, overrides=args)


def default_run_dir(root: str | Path = RUNS_DIR) -> Path:
    """``runs/<YYYY-mm-dd>/<HH-MM-SS-ffffff>``, the CLI's pattern (``configs/config.yaml``)."""
    now = datetime.now()
    return Path(root) / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S-%f")
