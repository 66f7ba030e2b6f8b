"""``accelopt.run`` and the testing kit as a caller's process finds and leaves them: torch's
default dtype and gradient mode, the run's ``accelopt.log``, the batch an early failure
names, a recorder given to two runs, the exported names, and a memory capacity beyond the
device."""

from __future__ import annotations

import io
import math
from pathlib import Path

import psutil
import pytest
import torch
from rich.console import Console

import accelopt
from accelopt.errors import UserError
from accelopt.plugin import PluginWarning
from accelopt.testing import HookRecorder, run_workload
from accelopt.units import format_bytes

pytestmark = pytest.mark.timeout(120)
SMALL_SINGLE = ["workload.jobs.0.iterations=2", "workload.jobs.0.width=8",
                "workload.jobs.0.batch_size=8"]
ONE_JOB = ["workload=single", "run.progress=false", "run.profile=false", "run.compare=none",
           *SMALL_SINGLE]
"""One small MLP job, two iterations, no profile: a run of about a second."""


class _SeesTheModel:
    """Keeps the dtypes of each built job's parameters and whether gradients were on."""

    seen: list[tuple[set[torch.dtype], bool]] = []

    def __init__(self, config: object = None) -> None:
        pass

    @accelopt.hookimpl
    def accelopt_job_built(self, run, job):
        type(self).seen.append(({p.dtype for p in job.model.parameters()},
                                torch.is_grad_enabled()))


def _registry() -> accelopt.Registry:
    registry = accelopt.Registry.discover()
    registry.add(accelopt.PluginSpec(name="sees_the_model", factory=_SeesTheModel))
    return registry


# --- torch's default dtype and gradient mode ---------------------------------------------


def test_a_float64_default_does_not_make_the_run_float64(tmp_path):
    _SeesTheModel.seen.clear()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        record = accelopt.run([*ONE_JOB, "+plugins=[sees_the_model]"], run_dir=tmp_path / "r",
                              registry=_registry())
        assert torch.get_default_dtype() == torch.float64, "the caller's default, given back"
    finally:
        torch.set_default_dtype(before)
    assert [j.status for j in record.jobs] == ["done"]
    assert _SeesTheModel.seen == [({torch.float32}, True)]


@pytest.mark.parametrize("off", ["no_grad", "set_grad_enabled"])
def test_a_run_trains_with_the_callers_gradients_off(tmp_path, off):
    try:
        if off == "no_grad":
            with torch.no_grad():
                record = accelopt.run(ONE_JOB, run_dir=tmp_path / "r")
                assert not torch.is_grad_enabled()
        else:
            torch.set_grad_enabled(False)
            record = accelopt.run(ONE_JOB, run_dir=tmp_path / "r")
            assert not torch.is_grad_enabled(), "the caller's mode, given back"
    finally:
        torch.set_grad_enabled(True)
    assert [(j.status, j.error) for j in record.jobs] == [("done", "")]
    assert all(math.isfinite(v) for v in record.jobs[0].losses)


def test_inference_mode_is_refused_in_one_line(tmp_path):
    with torch.inference_mode(), pytest.raises(UserError, match=r"inside torch\.inference_mode"
                                                                 r"\(\).*call it outside"):
        accelopt.run(ONE_JOB, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


# --- accelopt.log -------------------------------------------------------------------------


def test_an_api_run_writes_accelopt_log_as_the_cli_does(tmp_path):
    warned = [*ONE_JOB, "workload.jobs.0.min_lr=0.001"]  # has no effect: a warning line
    accelopt.run(warned, run_dir=tmp_path / "r")
    log = (tmp_path / "r" / "accelopt.log").read_text()
    assert "warning: job 'mlp'" in log and "min_lr=0.001 has no effect" in log
    assert "Jobs" in log and "1/1 done" in log


def test_a_callers_recording_console_keeps_what_it_had(tmp_path):
    console = Console(file=io.StringIO(), width=120, record=True)
    console.print("the caller's own line")
    accelopt.run(ONE_JOB, run_dir=tmp_path / "r", console=console)
    log = (tmp_path / "r" / "accelopt.log").read_text()
    assert "1/1 done" in log and "the caller's own line" not in log
    assert console.export_text().startswith("the caller's own line")


# --- the batch an early failure names -----------------------------------------------------


class NarrowerFrom:
    """A dataset whose batches have 20 features up to batch ``start`` and 17 from it on."""

    input_shape = (20,)
    num_classes = 5
    n_train = 1024

    def __init__(self, start: int) -> None:
        self.start = start

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        width = 20 if index < self.start else 17
        return (torch.randn(batch_size, width, generator=g),
                torch.randint(5, (batch_size,), generator=g))


def narrower_from(start: int = 2) -> NarrowerFrom:
    return NarrowerFrom(start)


@pytest.mark.parametrize("start", [1, 2])  # 1: the profile's saved-tensor forward; 2: a step
def test_a_failed_memory_step_describes_the_batch_that_failed(tmp_path, start):
    record = accelopt.run(["workload=single", "run.progress=false", "run.compare=none",
                           "workload.jobs.0.iterations=6", "workload.jobs.0.width=8",
                           "workload.jobs.0.batch_size=8",
                           "workload.jobs.0.dataset=test_api_state:narrower_from",
                           f"workload.jobs.0.dataset_kwargs={{start: {start}}}"],
                          run_dir=tmp_path / "r")
    (job,) = record.jobs
    assert job.status == "failed"
    assert "(8x17 and 20x" in job.error
    assert f"its batch (batch {start}): inputs (8, 17) float32" in job.error, job.error


# --- a recorder given to two runs ---------------------------------------------------------


def test_a_recorder_given_two_runs_keeps_them_apart(tmp_path):
    recorder = HookRecorder()
    quick = ["run.profile=false", "workload.jobs=[{name: m, model: mlp, width: 8, "
             "batch_size: 8, iterations: 2}]"]
    run_workload(["noop"], quick, tmp_path=tmp_path, recorder=recorder)
    run_workload([], quick, tmp_path=tmp_path, recorder=recorder)
    assert recorder.runs() == [0, 1]
    assert recorder.count("iteration_end", run=0) == recorder.count("iteration_end", run=1) == 2
    assert recorder.count("iteration_end") == 4
    with pytest.raises(ValueError, match=r"holds the calls of 2 runs; name one with run=N.*"
                                         r"fresh HookRecorder\(\).*clear\(\)"):
        recorder.assert_order(["run_end", "run_start"])
    recorder.assert_order(["run_start", "run_end"], run=1)
    with pytest.raises(AssertionError, match="run_start was not called after run_end"):
        recorder.assert_order(["run_end", "run_start"], run=1)
    recorder.clear()
    run_workload([], quick, tmp_path=tmp_path, recorder=recorder)
    assert recorder.runs() == [0]
    recorder.assert_order(["run_start", "iteration_end", "run_end"])


# --- exported names -----------------------------------------------------------------------


def test_the_documented_names_are_exported():
    import accelopt.testing
    from accelopt.records import RunRecord
    from accelopt.testing.recorder import Shipped

    assert accelopt.RunRecord is RunRecord and "RunRecord" in accelopt.__all__
    assert accelopt.testing.Shipped is Shipped and "Shipped" in accelopt.testing.__all__


# --- a memory capacity beyond the device --------------------------------------------------


def test_a_capacity_beyond_the_machines_memory_is_said():
    from accelopt.drivers.setup import (
        capacity_beyond_device,
        capacity_warning,
        device_memory,
        memory_capacity,
    )

    cpu = torch.device("cpu")
    ram = psutil.virtual_memory().total
    assert device_memory(cpu) == ram == memory_capacity("auto", cpu)
    line = capacity_warning("999TiB", cpu)
    assert line is not None and line.startswith("run.memory_capacity=999TiB (")
    assert f"this machine's RAM ({format_bytes(ram)})" in line
    assert "admitted against the setting" in line
    assert capacity_warning("1MiB", cpu) is None and capacity_warning("auto", cpu) is None
    assert capacity_beyond_device(ram, cpu, "x") is None


def test_salus_says_a_capacity_beyond_the_machines_memory(tmp_path: Path):
    with pytest.warns(PluginWarning, match=r"plugins\.salus\.capacity=999TiB .* more than "
                                           r"this machine's RAM"):
        record = run_workload(["salus"], ["plugins.salus.capacity=999TiB", *SMALL_SINGLE],
                              tmp_path=tmp_path, workload="single")
    (row,) = [r for r in record.plugin_rows if r.plugin == "salus"]
    assert "plugins.salus.capacity=999TiB" in row.summary


@pytest.mark.timeout(120)
def test_a_run_memory_capacity_beyond_the_machine_is_said(tmp_path: Path) -> None:
    """``run.memory_capacity=999TiB`` in one process admits jobs against 999 TiB: said, and
    kept in the run's record (it was accepted silently and read as enforced)."""
    record = accelopt.run(["workload=single", "run.progress=false", "run.profile=false",
                           "workload.jobs.0.iterations=2", "run.memory_capacity=999TiB"],
                          run_dir=tmp_path / "r")
    assert any(line.startswith("run.memory_capacity=999TiB (") for line in record.warnings)
