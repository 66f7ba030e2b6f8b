"""Shared fixtures: a tiny composed config and a runner that executes it in-process.

The suite is the CPU contract: it hides the machine's GPUs (``CUDA_VISIBLE_DEVICES=""``,
before anything asks CUDA), so ``run.device=auto`` means the CPU and a run's numerics and
outputs are the same on every machine. GPU paths are checked by ``benchmarks/gpu/run_all.sh``;
``ACCELOPT_TEST_GPU=1`` keeps the GPUs visible."""

from __future__ import annotations

import os

if os.environ.get("ACCELOPT_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by every rank and CLI subprocess

import io
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from omegaconf import DictConfig
from rich.console import Console

from accelopt.cli.hydra_run import compose_checked
from accelopt.config import register_plugin_configs, register_schema
from accelopt.plugin import PluginSpec, Registry
from accelopt.records import RunRecord
from accelopt.runtime.run import execute

RunFn = Callable[..., RunRecord]
MAX_TEST_WORKERS = 4
"""``-n auto`` (pyproject.toml) runs one pytest-xdist worker per core, at most this many: a
cluster test starts several rank processes of its own, so more workers than this on a large
machine only oversubscribe its cores."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    from accelopt.drivers.setup import usable_cores

    return max(1, min(usable_cores(), MAX_TEST_WORKERS))


@pytest.fixture(scope="session", autouse=True)
def one_rank_server_for_the_session():
    """Every in-process cluster run of the session forks its ranks from one forkserver, as
    the runs of one ``accelopt run`` invocation do (``drivers/processes.py``), instead of
    each starting its own (torch and the runtime imported again: ~1.5 s of CPU per run on
    2 cores). Each rank still gets the launcher's environment, ``sys.path`` and
    working directory at its start; the forkserver is stopped when the session ends."""
    from accelopt.drivers.processes import rank_server_started_early

    with rank_server_started_early({"ps"}):
        yield


@pytest.fixture
def one_numba_thread():
    """numba single-threaded for a test (SLIDE's active sets are then deterministic; the
    thread-scaling figures are benchmarks), its thread count given back after."""
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(1)
    yield
    numba.set_num_threads(before)


def compose_with(specs: Sequence[PluginSpec], overrides: Sequence[str]) -> DictConfig:
    register_schema()
    register_plugin_configs(list(specs))
    selection = ",".join(s.name for s in specs)
    plugin_override = [f"+plugins=[{selection}]"] if specs else []
    return compose_checked([*plugin_override, *overrides])


@pytest.fixture
def run_tiny(tmp_path: Path) -> RunFn:
    """Run a workload (default ``tiny``) in-process with the given plugin specs."""

    counter = iter(range(1000))

    def run(
        *specs: PluginSpec, overrides: Sequence[str] = (), workload: str = "tiny"
    ) -> RunRecord:
        registry = Registry.discover()
        for spec in specs:
            registry.add(spec)
        cfg = compose_with(
            specs, [f"workload={workload}", "run.progress=false", "run.telemetry_interval_s=5",
                    *overrides]
        )
        run_dir = tmp_path / f"run{next(counter)}"
        return execute(cfg, run_dir=run_dir, registry=registry, console=Console(file=io.StringIO()))

    return run
