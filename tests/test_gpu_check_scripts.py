"""The GPU checks' command lines (``benchmarks/gpu/*_check.py``): ``--help`` prints usage and
an unknown option is refused in one line with exit 2, both before the CUDA check. Five of
them parsed no arguments: ``--help`` and a typo printed ``SKIP: no CUDA device`` with exit 0
on a CPU, and on a GPU a typo started the whole check. Fast: no check runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"
CHECKS = ["kernels", "cluster", "salus", "tictac", "cli", "offload", "slide"]


def _run(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GPU / f"{name}_check.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=50)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", CHECKS)
def test_help_prints_usage_and_the_checks_summary(name: str, tmp_path: Path) -> None:
    done = _run(name, "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {name}_check.py")
    assert "GPU check" in done.stdout and "SKIP" not in done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", CHECKS)
def test_an_unknown_option_is_refused_before_the_check(name: str, tmp_path: Path) -> None:
    done = _run(name, "--bogus", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"{name}_check.py: error: unrecognized arguments: --bogus")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_cli_check_still_takes_cpu(tmp_path: Path) -> None:
    done = _run("cli", "--cpu", "--help", cwd=tmp_path)
    assert done.returncode == 0 and "--cpu" in done.stdout


@pytest.mark.timeout(90)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_run_all_calls_the_checks_as_they_parse_their_arguments(tmp_path: Path) -> None:
    """run_all.sh runs each check with no arguments: on a CPU each skips with exit 0."""
    (tmp_path / "benchmarks").symlink_to(GPU.parent)  # no .whl/ in this cwd: nothing installed
    env = {**os.environ, "OUT": str(tmp_path / "logs"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(GPU / "run_all.sh"), "kernels"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=80)
    assert done.returncode == 0, done.stdout + done.stderr
    log = (tmp_path / "logs" / "kernels.log").read_text()
    assert log.startswith("SKIP: no CUDA device"), log
