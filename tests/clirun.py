"""Run the real ``accelopt`` command in a subprocess (what a user types)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).parent


def accelopt_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "accelopt.cli.main", *args]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    env.setdefault("HYDRA_FULL_ERROR", "0")
    env.update(extra)
    return env


def accelopt(*args: str, cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        accelopt_cmd(*args), cwd=cwd, env=cli_env(**env), capture_output=True, text=True,
        timeout=timeout,
    )


def accelopt_in_process(*args: str, cwd: Path, capfd: Any) -> subprocess.CompletedProcess:
    """``accelopt ARGS`` in this process (``cli.main.main``), its exit code and output as
    :func:`accelopt` gives them (``capfd``: pytest's fixture, reading the file descriptors
    as a subprocess's pipes would). For the many one-line refusals, where an interpreter's
    start and imports (seconds each) are not what is tested; a few of them stay real
    commands. The working directory and torch's thread count are restored after."""
    import torch

    from accelopt.cli.main import main

    threads, here = torch.get_num_threads(), os.getcwd()
    capfd.readouterr()  # what came before is not the command's
    code = 0
    os.chdir(cwd)
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(accelopt_cmd(*args), code, out, err)


def the_error_line(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line a failed command printed on stderr (a ValueError unpacking it
    where there is none, or more than one: a user error is one line)."""
    (line,) = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    return line


def run_files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory and its bytes (to prove nothing rewrote them)."""
    return {str(p.relative_to(run_dir)): p.read_bytes()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def saved_weights(run_dir: Path) -> dict:
    """The one job's final weights a run saved (``weights/<job_id>.pt``)."""
    import torch

    (path,) = (run_dir / "weights").glob("*.pt")
    return torch.load(path, weights_only=True)


def run_in_process(*args: str, run_dir: Path):
    """The same run as ``accelopt run ARGS hydra.run.dir=RUN_DIR``, in this process
    (``accelopt.run``): no interpreter start and no imports to pay, for tests where the
    command line itself is not what is tested. torch's thread count is restored after
    (``run.threads`` sets it for the process)."""
    import torch

    import accelopt

    threads = torch.get_num_threads()
    try:
        return accelopt.run(list(args), run_dir=run_dir)
    finally:
        torch.set_num_threads(threads)


def sweep_in_process(sweep: list[str], out: Path, *extra: str) -> int:
    """``accelopt run -m SWEEP EXTRA hydra.sweep.dir=OUT`` in this process; its exit code.
    torch's thread count is restored after (``run.threads`` sets it for the process)."""
    import torch

    from accelopt.cli.main import main

    threads = torch.get_num_threads()
    try:
        main(["run", "-m", *sweep, *extra, f"hydra.sweep.dir={out}"])
        return 0
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        torch.set_num_threads(threads)
