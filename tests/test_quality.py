"""Quality in every run: each training job's final model on its held-out set, beside the
speed figures (``accelopt/job/quality.py``)."""

from __future__ import annotations

import csv

import pytest
import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.job import Job
from accelopt.job.quality import evaluate, score_result
from accelopt.records import JobResult
from accelopt.report.metrics import run_metrics

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


def test_every_training_job_reports_its_held_out_accuracy(run_tiny):
    record = run_tiny(overrides=["run.compare=none"])
    for result in record.jobs:
        q = result.quality
        assert q is not None and q.metric == "accuracy" and 0.0 <= q.value <= 1.0, result
        assert q.samples > 0
    assert run_metrics(record)["avg_quality"] == pytest.approx(
        sum(r.quality.value for r in record.jobs) / len(record.jobs))
    with open(f"{record.info.run_dir}/metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["quality"]) for r in rows] == [r.quality.value for r in record.jobs]
    import json

    with open(f"{record.info.run_dir}/metrics.json") as fh:
        jobs = json.load(fh)["jobs"]
    for job, result in zip(jobs, record.jobs, strict=True):  # every run keeps its loss curve
        assert job["losses"] == result.losses and len(job["losses"]) == result.job.iterations


def test_it_is_the_trained_model_scored_on_the_held_out_set():
    spec = JobConfig(name="q", model="mlp", width=32, batch_size=32, iterations=30, seed=1,
                     dataset="digits")
    job = Job(spec, job_id="q", device=CPU)
    untrained = evaluate(job.model, job.dataset)
    for _ in range(spec.iterations):
        job.step()
    result = JobResult(job.info, status="done")
    score_result(result, spec, job.model, job.dataset)
    assert job.model.training, "scoring leaves the model in the mode it found it"
    x, y = job.dataset.eval_set()
    with torch.no_grad():
        job.model.eval()
        by_hand = float((job.model(x).argmax(1) == y).double().mean())
    assert result.quality.value == pytest.approx(by_hand)
    assert result.quality.samples == len(y) and result.quality.value > untrained.value + 0.2


def test_jobs_that_are_not_scored_say_why():
    spec = JobConfig(name="q", model="mlp", width=16, batch_size=8, iterations=1)
    job = Job(spec, job_id="q", device=CPU)
    cases = [
        (JobConfig(**{**spec.__dict__, "evaluate": False}), "done", job.model, "evaluate: false"),
        (JobConfig(**{**spec.__dict__, "kind": "infer"}), "done", job.model, "inference job"),
        (spec, "failed", job.model, "did not finish"),
        (spec, "done", None, "not in this process"),
        (spec, "done", nn.Sequential(nn.Flatten(), nn.Unflatten(1, (4, 16))), "cannot score"),
    ]
    for s, status, model, words in cases:
        result = JobResult(job.info, status=status)
        score_result(result, s, model, job.dataset)  # never raises
        assert result.quality is None and words in result.quality_note, result.quality_note
        assert "\n" not in result.quality_note


def test_a_trained_job_whose_scoring_failed_says_so_under_the_jobs_table():
    """Its held-out column read "–", as for a job with no held-out set: a plugin that
    changed its numerics (pruning an LM) looked like a pure speed-up."""
    import io

    from rich.console import Console

    from accelopt.records import RunRecord
    from accelopt.report.summary import render_summary
    from accelopt.types import RunInfo

    spec = JobConfig(name="q", model="mlp", width=16, batch_size=8, iterations=1)
    job = Job(spec, job_id="q", device=CPU)
    failed, absent = JobResult(job.info, status="done"), JobResult(job.info, status="done")
    score_result(failed, spec, nn.Sequential(nn.Flatten(), nn.Unflatten(1, (4, 16))),
                 job.dataset)
    score_result(absent, JobConfig(**{**spec.__dict__, "evaluate": False}), job.model,
                 job.dataset)
    out = io.StringIO()
    render_summary(RunRecord(info=RunInfo("r", "cpu", (), (), 0), jobs=[failed, absent]),
                   Console(file=out, width=200))
    notes = [ln for ln in out.getvalue().splitlines() if ln.startswith("note")]
    assert len(notes) == 1 and notes[0].startswith("note q: not scored, cannot score: "), notes
    assert "its quality is unknown" in notes[0]


def test_a_diverged_job_is_not_scored_by_an_argmax_over_nan(run_tiny):
    """A job that trains to its last iteration on a NaN loss used to read 'done', loss '–'
    and a held-out accuracy of whatever class an argmax over NaN picks."""
    record = run_tiny(overrides=[
        "workload.jobs=[{name: d, model: mlp, width: 16, batch_size: 16, iterations: 20, "
        "lr: 1.0e+06, dataset: digits}]", "run.compare=none"])
    (result,) = record.jobs
    assert result.status == "done" and result.diverged_at is not None
    assert result.quality is None and "the loss diverged" in result.quality_note
    import io

    from rich.console import Console

    from accelopt.report.summary import render_summary

    out = io.StringIO()
    render_summary(record, Console(file=out, width=200))
    assert "diverged d: its loss is not finite" in out.getvalue()
    assert "(a learning rate too high, nan or inf in the data, or a plugin's change?)" in out.getvalue()
    assert "Run: 1/1 done (1 diverged), 0 failed" in out.getvalue()
    from accelopt.report import run_metrics

    assert run_metrics(record)["n_diverged"] == 1


def test_a_first_loss_that_is_not_finite_is_not_blamed_on_the_learning_rate(run_tiny):
    """nan in the data made the first loss nan, before any update; the line asked whether
    the learning rate was too high."""
    import io

    from rich.console import Console

    from accelopt.report.summary import render_summary

    record = run_tiny(overrides=[
        "workload.jobs=[{name: n, model: mlp, width: 16, batch_size: 16, iterations: 3, "
        "dataset: 'byo_models:with_a_nan'}]", "run.compare=none"])
    (result,) = record.jobs
    assert result.diverged_at == 0  # an index: the first loss
    out = io.StringIO()
    render_summary(record, Console(file=out, width=200))
    assert ("from loss 1 of 3 (the first, before any update: nan or inf in the data or the "
            "initial weights, or a plugin's change)") in out.getvalue()


def test_a_head_wider_than_the_classes_is_scored_with_a_note():
    """A model left at a library's default width (1,000 classes for 10) trains without an
    error; its score says so, under the jobs table too. The zoo's own models fit."""
    import io

    from rich.console import Console

    from accelopt.records import RunRecord
    from accelopt.report import render_summary
    from accelopt.types import RunInfo

    spec = JobConfig(name="wide", model="mlp", width=16, batch_size=16, iterations=1, seed=1,
                     dataset="digits")
    job = Job(spec, job_id="wide", device=CPU)
    fit = JobResult(job.info, status="done")
    score_result(fit, spec, job.model, job.dataset)
    assert fit.quality is not None and fit.quality.note == "" and fit.quality_note == ""
    wide = nn.Sequential(nn.Flatten(), nn.Linear(64, 1000))
    result = JobResult(job.info, status="done")
    score_result(result, spec, wide, job.dataset)
    note = ("the model gives 1000 scores per point for the dataset's 10 classes: its output "
            "layer does not match the labels (num_classes of its factory?); scored as it is")
    assert result.quality is not None and result.quality.note == note
    assert result.quality_note == note  # metrics.json's column
    out = io.StringIO()
    render_summary(RunRecord(info=RunInfo(run_dir="r", device="cpu", plugins=(), jobs=(job.info,),
                                          seed=0), jobs=[result]), Console(file=out, width=400))
    assert f"note wide: {note}" in out.getvalue()


@pytest.mark.parametrize("case", ["nan logits", "float labels"])
def test_scoring_refuses_what_no_argmax_can_score(case):
    from accelopt.job.quality import score

    x, y = torch.ones(4, 3), torch.tensor([0, 1, 2, 0])
    model: nn.Module = nn.Linear(3, 3)
    if case == "nan logits":
        with torch.no_grad():
            model.weight.fill_(float("nan"))
        words = "not finite"
    else:
        y = y.float()[:, None]  # a regression target
        words = "not class ids"
    with pytest.raises(ValueError, match=words):
        score(model, [(x, y)])


def test_a_cluster_run_scores_the_gathered_weights_like_one_process(run_tiny):
    local = run_tiny(overrides=["run.compare=none"])
    ps = run_tiny(overrides=["run.compare=none", "cluster.mode=ps"])
    mlp = [r for r in local.jobs if r.job.model == "mlp"][0]
    mlp_ps = [r for r in ps.jobs if r.job.model == "mlp"][0]
    # PS trains the MLP as one process does (same weights up to float rounding)
    assert abs(mlp_ps.quality.value - mlp.quality.value) <= 1 / mlp.quality.samples
    assert all(r.quality is not None for r in ps.jobs)


def test_run_compare_shows_quality_beside_speed(run_tiny):
    from plugins_for_tests import RANK_REPORTER

    record = run_tiny(RANK_REPORTER, overrides=["run.compare=baseline"])
    assert "compare.baseline.avg_quality" in record.metrics


def test_multi_label_data_gets_p_at_1_and_p_at_5_as_defined():
    """P@k: the share of the k best-scored classes among a point's labels (padded with -1)."""
    from accelopt.job.quality import hits_at_1, hits_at_5, score

    logits = torch.tensor([[9.0, 8, 7, 6, 5, 4, 0], [0.0, 1, 2, 3, 4, 5, 6]])
    labels = torch.tensor([[0, 6, -1], [2, 3, 5]])
    assert hits_at_1(logits, labels).tolist() == [1.0, 0.0]
    # point 0: top five 0..4, labels {0, 6} -> 1 of 5; point 1: top five 6..2 -> {2, 3, 5}: 3/5
    assert hits_at_5(logits, labels).tolist() == pytest.approx([0.2, 0.6])
    model = nn.Identity()
    p1, n, multi, p5, width = score(model, [(logits, labels)])
    assert (p1, n, multi, width) == (0.5, 2, True, 7) and p5 == pytest.approx(0.4)
    single = score(model, [(logits, torch.tensor([0, 6]))])
    assert single[2] is False and single[0] == 1.0


def test_minus_inf_is_a_class_not_scored_and_plus_inf_is_still_refused():
    """A sampled output layer's LSH inference gives its unretrieved classes -inf: held-out
    scoring refused the whole model ('not finite'). -inf is no prediction: a row of them
    scores no hit (argmax would pick class 0), and a -inf among the top five is no hit."""
    from accelopt.job.quality import score

    ninf = float("-inf")
    logits = torch.tensor([[ninf, 3.0, ninf, ninf, ninf, ninf],
                           [ninf, ninf, ninf, ninf, ninf, ninf],
                           [2.0, 1.0, ninf, ninf, ninf, ninf]])
    labels = torch.tensor([[1, 2, -1], [0, -1, -1], [2, 0, -1]])
    p1, n, multi, p5, _ = score(nn.Identity(), [(logits, labels)])
    assert (p1, n, multi) == (pytest.approx(2 / 3), 3, True)
    assert p5 == pytest.approx((1 / 5 + 0 + 1 / 5) / 3)  # class 2's -inf is not a hit
    with pytest.raises(ValueError, match=r"not finite \(nan or \+inf\)"):
        score(nn.Identity(), [(torch.tensor([[float("inf"), 0.0]]), torch.tensor([0]))])
