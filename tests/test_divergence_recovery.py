"""A job diverged when its trained weights are not finite, or, where they are not known in
the process scoring it, when its losses are not finite to the end. A loss of nan from a
step a plugin skipped, or from a batch with no labelled row, followed by finite ones with
finite weights, was reported "diverged ... not scored" (exit 3); nan weights left by the
last step, after finite losses, were reported done, 0 failed (exit 0)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn
from torch.utils.data import TensorDataset

from accelopt.records import JobResult, RunRecord
from accelopt.types import JobInfo, RunInfo

pytestmark = pytest.mark.timeout(120)

TESTS = str(Path(__file__).parent)
HERE = Path(__file__).stem
NAN = float("nan")


class _Counting(nn.Module):
    """A linear classifier counting its training forwards (held-out scoring runs in eval
    mode and is not counted)."""

    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.lin = nn.Linear(math.prod(input_shape), num_classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return self.lin(x.flatten(1))


class NanOnThird(_Counting):
    """Its third training forward's output is nan (a step a plugin can skip)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * NAN if self.training and self.calls == 3 else out


class NanGradientOnSixth(_Counting):
    """Its sixth training forward adds ``sqrt(0)``: the loss stays finite, the gradient is
    ``inf * 0``, nan, so that step leaves every weight nan."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training and self.calls == 6:
            out = out + torch.sqrt((self.lin.weight * 0).sum())
        return out


def nan_on_third(*, input_shape, num_classes) -> nn.Module:
    return NanOnThird(input_shape, num_classes)


def nan_gradient_on_sixth(*, input_shape, num_classes) -> nn.Module:
    return NanGradientOnSixth(input_shape, num_classes)


def one_labelled(*, seed: int):
    """Gaussian blobs whose training labels are all -100 (no loss) but row 0's: a batch
    without it has a loss of nan (a mean over nothing) and a gradient of zero."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(4, 16, generator=g) * 2

    def draw(count: int) -> TensorDataset:
        y = torch.randint(4, (count,), generator=g)
        return TensorDataset(means[y] + torch.randn(count, 16, generator=g), y)

    train, held_out = draw(64), draw(64)
    x, y = train.tensors
    y = torch.full_like(y, -100)
    y[0] = 3  # the highest class: the dataset's class count is read from its labels
    return TensorDataset(x, y), held_out


def _trained(spec):
    """The job trained in this process, and its result as the executor records it."""
    from accelopt.job import Job

    job = Job(spec, job_id=spec.name, device=torch.device("cpu"))
    losses = [job.step().loss for _ in range(spec.iterations)]
    result = JobResult(job.info, status="done", losses=losses, final_loss=losses[-1],
                       iterations_done=spec.iterations)
    return job, result


def _scored(spec):
    from accelopt.job.quality import score_result

    job, result = _trained(spec)
    score_result(result, spec, job.model, job.dataset)
    return job, result


def _summary(*results: JobResult) -> str:
    from accelopt.report.summary import render_summary

    out = io.StringIO()
    render_summary(RunRecord(info=RunInfo("r", "cpu", (), (), 0), jobs=list(results)),
                   Console(file=out, width=300))
    return out.getvalue()


def test_batches_with_no_labelled_row_are_no_divergence(monkeypatch):
    """Losses of nan from batches with nothing to predict, weights finite: scored, with a
    note; it read "diverged ... from loss 1 of 8 (the first, before any update ...)"."""
    from accelopt.config import JobConfig
    from accelopt.report.metrics import job_metrics

    monkeypatch.syspath_prepend(TESTS)
    spec = JobConfig(name="b", model="mlp", dataset=f"{HERE}:one_labelled", batch_size=8,
                     iterations=8, seed=1)
    _job, result = _scored(spec)
    bad = [i for i, loss in enumerate(result.losses) if not math.isfinite(loss)]
    assert bad and bad[0] == 0 and len(bad) < len(result.losses), result.losses
    assert result.weights_finite is True
    assert result.diverged_at is None and result.quality is not None, result.quality_note
    assert (f"{len(bad)} of 8 losses not finite (first: loss 1); its weights stayed finite "
            "(a skipped step, or a batch with no labelled point)") in result.quality_note
    assert job_metrics(result)["diverged"] is False
    text = _summary(result)
    assert "diverged" not in text and "Run: 1/1 done, 0 failed" in text
    assert f"note b: {result.quality_note}" in " ".join(text.split())


def test_a_step_the_clip_plugin_skipped_is_no_divergence(tmp_path, monkeypatch):
    """A nan output on the third forward, its step skipped by ``clip``: the run said
    ``diverged mlp: its loss is not finite from loss 3 of 6``, exit 3, not scored."""
    pytest.importorskip("accelopt_clip")
    from clirun import run_in_process

    monkeypatch.syspath_prepend(TESTS)
    record = run_in_process(
        f"workload.jobs=[{{name: c, model: '{HERE}:nan_on_third', batch_size: 16, "
        "iterations: 6, dataset: digits, seed: 1}]", "+plugins=[clip]", "run.compare=none",
        "run.progress=false", run_dir=tmp_path / "run")
    (result,) = record.jobs
    assert result.status == "done" and not math.isfinite(result.losses[2]), result.losses
    assert result.diverged_at is None and result.quality is not None, result.quality_note
    assert "1 of 6 losses not finite (first: loss 3)" in result.quality_note
    assert record.summary["n_diverged"] == 0


def test_nan_weights_after_finite_losses_diverged(monkeypatch):
    """The last step's gradient of nan, every loss finite: it was done, 0 failed, its
    weights all nan, with only a "cannot score" note."""
    from accelopt.config import JobConfig
    from accelopt.report.metrics import job_metrics
    from accelopt.report.summary import diverged_text

    monkeypatch.syspath_prepend(TESTS)
    spec = JobConfig(name="w", model=f"{HERE}:nan_gradient_on_sixth", dataset="digits",
                     batch_size=16, iterations=6, seed=1)
    job, result = _scored(spec)
    assert all(math.isfinite(loss) for loss in result.losses), result.losses
    assert torch.isnan(job.model.lin.weight).all()
    assert result.weights_finite is False and result.diverged_at == 6
    assert result.quality is None
    assert result.quality_note == ("not scored: the job diverged (its weights are not finite "
                                   "after its last step, every loss finite)")
    assert job_metrics(result)["diverged"] is True
    assert diverged_text(result) == (
        "w: its weights are not finite after its last step, every loss finite (a learning "
        "rate too high, nan or inf in the data, or a plugin's change?)")
    assert "Run: 1/1 done (1 diverged), 0 failed" in _summary(result)


def _result(losses: list[float | None], weights: bool | None = None) -> JobResult:
    info = JobInfo(job_id="j", name="j", model="mlp", kind="train", arrival_s=0.0,
                   iterations=len(losses), batch_size=4)
    return JobResult(info, status="done", losses=losses, weights_finite=weights)


def test_where_its_weights_are_not_known_the_trailing_losses_decide():
    """A loss of nan then finite ones (None: nan after JSON from a rank) is no divergence;
    losses not finite to the end are, from the first of them; finite weights always win,
    and weights that are not finite give the trailing run's start."""
    assert _result([2.0, NAN, 1.5]).diverged_at is None
    assert _result([2.0, None, 1.5]).nonfinite_note.startswith(
        "1 of 3 losses not finite (first: loss 2); the losses after them are finite")
    assert _result([2.0, NAN, 1.5, None, math.inf]).diverged_at == 3
    assert _result([NAN, NAN]).diverged_at == 0
    assert _result([2.0, NAN, NAN], weights=True).diverged_at is None
    assert _result([2.0, NAN, 1.0, NAN], weights=False).diverged_at == 3
    assert _result([2.0, 1.0], weights=False).diverged_at == 2
    assert _result([2.0, NAN, NAN]).nonfinite_note == ""  # diverged: said as that
    assert _result([]).diverged_at is None


def test_the_kit_names_weights_that_diverged_after_finite_losses():
    from accelopt.testing.conformance import _check_jobs_done

    record = RunRecord(info=RunInfo("r", "cpu", (), (), 0),
                       jobs=[_result([2.0, 1.0], weights=False)])
    with pytest.raises(AssertionError, match=r"under it j \(tiny\) diverged: its weights are not "
                                             r"finite after its last step, every loss finite"):
        _check_jobs_done("p", "tiny", record)


def test_a_mask_buffer_of_minus_inf_is_no_divergence_nan_statistics_are():
    """A causal mask registered as a buffer holds ``-inf`` by design; batch norm's running
    statistics of nan are a diverged model's."""
    from accelopt.job.quality import weights_finite

    masked = nn.Linear(4, 4)
    masked.register_buffer("mask", torch.triu(torch.full((4, 4), -math.inf), 1))
    assert weights_finite(masked)
    norm = nn.BatchNorm1d(4)
    norm.running_mean[0] = NAN
    assert not weights_finite(norm)
    inf_weight = nn.Linear(4, 4)
    with torch.no_grad():
        inf_weight.weight[0, 0] = math.inf
    assert not weights_finite(inf_weight)
