"""Labels -100 (PyTorch cross-entropy's ``ignore_index``) with the job's default loss.

The default cross-entropy is a mean over the labelled positions, not the rows: a cluster
whose workers each train on some rows of the batch weighs each worker's loss and gradient by
its labelled positions (``Job.loss_share``), as ``loss: model`` does, so it trains one
process's objective, and a worker whose rows are all -100 (a nan loss of its own) spoils
nothing. Held-out scoring leaves -100 points out rather than counting them as misses.

The split is simulated in this process, as each worker computes it: the job reads its rows
of the batch (``Job._rows``) and its share, and the workers' losses and gradients are
combined as the cluster combines them (``combined_loss``; a gradient scaled by its share, a
share of 0 sending zeros).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.drivers.cluster.outcome import combined_loss
from accelopt.job import Job
from accelopt.job.job import job_loss_convention
from accelopt.job.quality import NONE_LABELLED, evaluate, score_result
from accelopt.records import JobResult

TESTS = str(Path(__file__).parent)
CPU = torch.device("cpu")
BATCH, FEATURES, CLASSES, STEPS = 32, 20, 5, 4


class Ignored:
    """x ~ randn, y ~ randint(5); rows ``0..ignored-1`` of every batch labelled -100 (so the
    first worker's half holds fewer labelled rows than the second's, or none). ``steps``: the
    labels are ``[B, steps]`` positions (a sequence), row ``r`` with ``r % steps`` of them
    -100, the rows differing in their labelled positions."""

    input_kind = "vector"
    vocab_size = None

    def __init__(self, ignored: int, steps: int = 0) -> None:
        g = torch.Generator().manual_seed(0)
        self.input_shape, self.num_classes = (FEATURES,), CLASSES
        n = BATCH * 4
        self.x = torch.randn(n, FEATURES, generator=g)
        shape = (n, steps) if steps else (n,)
        self.y = torch.randint(CLASSES, shape, generator=g)
        rows = torch.arange(n) % BATCH
        self.y[rows < ignored] = -100
        if steps:
            for r in range(n):
                self.y[r, : r % steps] = -100

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = (index * batch_size) % len(self.y)
        return self.x[lo:lo + batch_size], self.y[lo:lo + batch_size]


class PerStep(nn.Module):
    """Logits ``[B, classes, steps]`` (cross-entropy's K-dimensional form)."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.lin = nn.Linear(FEATURES, CLASSES * steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(len(x), CLASSES, self.steps)


def linear(*, input_shape, num_classes) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))


def per_step(*, input_shape, num_classes) -> nn.Module:
    return PerStep(3)


def rows_12() -> Ignored:
    return Ignored(12)


def rows_16() -> Ignored:
    return Ignored(16)


def seq_10() -> Ignored:
    return Ignored(10, steps=3)


@pytest.fixture
def importable(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def job_for(dataset: str, model: str = "test_ignored_labels:linear") -> Job:
    spec = JobConfig(name="ig", model=model, dataset=f"test_ignored_labels:{dataset}",
                     batch_size=BATCH, iterations=STEPS, optimizer="sgd", lr=0.1, seed=0)
    return Job(spec, job_id="ig", device=CPU)


def loss_and_grads(job: Job, index: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The job's loss of its rows of batch ``index`` and their gradients."""
    x, y = job.batch(index)
    job.model.zero_grad(set_to_none=True)
    loss = job.loss_fn(job.model(x), y)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in job.model.named_parameters()}


def split(job: Job, index: int, workers: int = 2
          ) -> tuple[float, dict[str, torch.Tensor], list[float | None]]:
    """Batch ``index`` trained as ``workers`` workers do, combined as the cluster does."""
    size = BATCH // workers
    records, grads, weights = [], [], []
    for w in range(workers):
        job._rows = (w * size, (w + 1) * size)
        loss, grad = loss_and_grads(job, index)
        weights.append(job.loss_share)
        records.append({"loss": loss, "weight": job.loss_share})
        grads.append(grad)
    job._rows = None
    shares = [1 / workers] * workers
    total = combined_loss(records, shares)
    combined = {}
    for name in grads[0]:
        parts = [torch.zeros_like(g[name]) if (s if w is None else w) == 0 else
                 g[name] * (s if w is None else w)
                 for g, w, s in zip(grads, weights, shares, strict=True)]
        combined[name] = torch.stack(parts).sum(0)
    return total, combined, weights


@pytest.mark.parametrize(("dataset", "model", "weights"), [
    ("rows_12", "linear", [4 / 20, 16 / 20]),  # uneven halves: by rows they weigh alike
    ("rows_16", "linear", [0.0, 1.0]),  # worker 0's rows all -100: a nan loss of its own
    ("seq_10", "per_step", None),  # [B, T] positions, a mean over the labelled ones
])
def test_a_split_batch_trains_one_processs_loss(importable, dataset, model, weights):
    job = job_for(dataset, f"test_ignored_labels:{model}")
    for index in range(2):
        one_loss, one_grads = loss_and_grads(job, index)
        loss, grads, shares = split(job, index)
        assert math.isfinite(one_loss) and math.isfinite(loss), (one_loss, loss)
        assert loss == pytest.approx(one_loss, abs=1e-6)
        for name, grad in one_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=0)
        if weights is not None:
            assert shares == pytest.approx(weights, abs=1e-9)
        else:
            assert all(s is not None for s in shares) and sum(shares) == pytest.approx(1.0)


def test_the_default_losss_convention():
    """Cross-entropy with ignore_index -100 and a mean: over labelled positions; any other
    dataset loss (class weights, another reduction, the XC softmax loss): over rows."""

    class With:
        def __init__(self, fn) -> None:
            self.loss_fn = fn

    assert job_loss_convention(object()) == "labels"
    assert job_loss_convention(With(None)) == "labels"
    assert job_loss_convention(With(nn.CrossEntropyLoss())) == "labels"
    assert job_loss_convention(With(nn.CrossEntropyLoss(weight=torch.ones(3)))) == "rows"
    assert job_loss_convention(With(nn.CrossEntropyLoss(reduction="sum"))) == "rows"
    assert job_loss_convention(With(nn.CrossEntropyLoss(ignore_index=-1))) == "rows"
    assert job_loss_convention(With(lambda out, y: out.sum())) == "rows"


class HeldOut:
    """A held-out set of 128 points, labels -100 where ``mask``."""

    input_shape, num_classes = (FEATURES,), CLASSES

    def __init__(self, mask: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(128, FEATURES, generator=g)
        self.labels = torch.randint(CLASSES, (128,), generator=g)
        self.y = self.labels.masked_fill(mask, -100)

    def eval_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def test_held_out_points_labelled_minus_100_are_not_scored():
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES)
    mask = torch.zeros(128, dtype=torch.bool)
    mask[::2] = True
    data = HeldOut(mask)
    q = evaluate(model, data)
    with torch.no_grad():
        hits = model(data.x[1::2]).argmax(1) == data.y[1::2]
    assert q.samples == 64
    assert q.value == pytest.approx(float(hits.double().mean()))


def test_a_held_out_set_with_no_labelled_point_is_not_scored():
    model = nn.Linear(FEATURES, CLASSES)
    spec = JobConfig(name="q", model="mlp")
    result = JobResult(job_for_info(), status="done")
    score_result(result, spec, model, HeldOut(torch.ones(128, dtype=torch.bool)))
    assert result.quality is None
    assert result.quality_note == NONE_LABELLED


def job_for_info():
    from accelopt.job.job import job_info

    return job_info(JobConfig(name="q", model="mlp"), "q")
