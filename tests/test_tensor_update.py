"""The per-tensor update a PS server's early update uses (``accelopt.job.optim.step_tensors``,
``Job._tensor_update``): stepping the tensors a few at a time, in any grouping, gives the
bits of one optimizer step over all of them, and the job refuses it where a step reads more
than one tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.job import Job
from accelopt.job.events import SILENT
from accelopt.job.optim import PER_TENSOR_OPTIMIZERS, step_tensors

pytestmark = pytest.mark.timeout(60)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01, weight_decay=1e-3)
    groups = [{"params": params[:2], "lr": 0.01}, {"params": params[2:], "lr": 0.02}]
    return torch.optim.AdamW(groups, weight_decay=1e-2)  # two groups, two rates


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_stepping_tensors_in_subsets_is_bitwise_one_step(kind):
    whole, parts = _model(), _model()
    opt_whole = _optimizer(kind, list(whole.parameters()))
    opt_parts = _optimizer(kind, list(parts.parameters()))
    group_of = {id(p): g for g, group in enumerate(opt_parts.param_groups)
                for p in group["params"]}
    x = torch.randn(4, 6)
    for _ in range(3):  # state (momentum, moments, step counts) carries over the steps
        for model in (whole, parts):
            model.zero_grad()
            model(x).pow(2).sum().backward()
        opt_whole.step()
        params = list(parts.parameters())
        for subset in ([params[3]], [params[0], params[2]], [params[1]]):  # arrival order
            step_tensors(opt_parts, subset, [group_of[id(p)] for p in subset])
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [len(g["params"]) for g in opt_parts.param_groups] == \
        [len(g["params"]) for g in opt_whole.param_groups]  # the groups are restored


def test_the_job_refuses_the_per_tensor_update_where_a_step_reads_every_gradient():
    spec = JobConfig(name="j", model="mlp", width=8, batch_size=4, iterations=2, seed=0)
    job = Job(spec, job_id="j", device=torch.device("cpu"))
    assert type(job.optimizer) in PER_TENSOR_OPTIMIZERS
    assert job._tensor_update(0, SILENT) is not None and job.whole_step_reason == ""
    clipped = Job(JobConfig(name="c", model="mlp", width=8, batch_size=4, iterations=2,
                            seed=0, grad_clip=1.0), job_id="c", device=torch.device("cpu"))
    assert clipped._tensor_update(0, SILENT) is None
    assert "grad_clip=1.0" in clipped.whole_step_reason
