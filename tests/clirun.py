"""Run the real ``accelopt`` command in a subprocess (what a user types)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
