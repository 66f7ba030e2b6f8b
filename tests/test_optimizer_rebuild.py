"""A plugin changes the model mid-run and the optimizer follows: accelopt_after_step answers
OptimizerRebuild, the core rebuilds the optimizer over the current parameters (carrying the
state of the unchanged ones) and offers it to accelopt_optimizer_build."""

from __future__ import annotations

import pytest
from plugins_for_tests import SHRINK, WRAP_OPTIMIZER

from accelopt.errors import UserError

pytestmark = pytest.mark.timeout(120)
MLP = ["workload.jobs=[{name: m, model: mlp, width: 16, batch_size: 8, iterations: 5}]",
       "run.threads=1"]


def test_a_model_changed_after_a_step_keeps_training_with_a_rebuilt_optimizer(run_tiny):
    record = run_tiny(SHRINK, overrides=MLP)
    (job,) = record.jobs
    assert job.status == "done" and job.iterations_done == 5, job.error
    # the record carries the new parameter table: the hidden layer is half as wide
    hidden = job.job.parameter("net.1.weight")
    assert hidden.shape == (8, job.job.parameter("net.1.weight").shape[1])
    (row,) = [r for r in record.plugin_rows if r.plugin == "shrink"]
    assert row.summary == "shrunk at 2"
    # built once at build time (no previous), once at the rebuild (with the previous one)
    assert row.metrics["builds"] == "SGD:False;SGD:True"


def test_the_unchanged_parameters_keep_their_optimizer_state():
    import torch

    from accelopt.config import JobConfig
    from accelopt.host import PluginHost
    from accelopt.job import Job

    plugin = SHRINK.instantiate()
    host = PluginHost([(SHRINK, plugin)])
    job = Job(JobConfig(name="m", model="mlp", width=16, batch_size=8, iterations=5),
              job_id="m", device=torch.device("cpu"), host=host)
    from accelopt.job import StepEvents

    events = StepEvents(host)
    last = job.model.net[5].weight
    for _ in range(3):
        job.step(events)
    momentum = job.optimizer.state[last]["momentum_buffer"]
    assert job.model.net[5].weight is last  # the head was not touched
    assert torch.count_nonzero(momentum) > 0
    assert job.rebuilds == ["iteration 2: hidden width halved to 8"]  # after its step
    job.step(events)  # trains on with the rebuilt optimizer


def test_in_a_cluster_run_a_changed_parameter_table_is_refused_in_one_line(tmp_path):
    from accelopt.drivers.cluster import RankFailed
    from accelopt.testing import run_workload

    with pytest.raises((RankFailed, UserError)) as info:
        run_workload([SHRINK], [*MLP, "cluster.mode=allreduce", "cluster.timeout_s=20"],
                     tmp_path=tmp_path)
    assert "changed the model's parameters during a cluster run" in str(info.value)
    assert "\n" not in str(info.value)


def test_an_optimizer_wrapped_in_a_subclass_with_attributes_of_its_own_trains(run_tiny):
    """torch's Optimizer.__getstate__ drops a wrapper's own attributes (its ``base``), so a
    deep copy for the profile used to fail the job ("no attribute 'base'") in a
    single-process run; the profile's copy keeps them and the run's wrapper takes each step."""
    record = run_tiny(WRAP_OPTIMIZER, overrides=MLP)
    (job,) = record.jobs
    assert job.status == "done" and job.iterations_done == 5, job.error
    (row,) = [r for r in record.plugin_rows if r.plugin == "wrap_optimizer"]
    assert row.metrics["steps"] == 5  # the profile stepped a copy, not the run's wrapper


def test_the_profile_copy_of_a_wrapped_optimizer_steps_the_copied_parameters():
    import copy

    import torch
    from plugins_for_tests import _DelegatingOptimizer

    from accelopt.job.profile import copy_optimizer

    model = torch.nn.Linear(3, 2)
    wrapper = _DelegatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model(torch.ones(1, 3)).sum().backward()
    wrapper.step()
    memo: dict = {}
    model_copy = copy.deepcopy(model, memo)
    clone = copy_optimizer(wrapper, memo)
    assert clone.steps == 1 and isinstance(clone.base, torch.optim.SGD)
    copied = list(model_copy.parameters())
    assert clone.base.param_groups[0]["params"] == copied
    assert all(p in clone.base.state for p in copied)  # momentum, keyed by the copies
    before = [p.detach().clone() for p in model.parameters()]
    clone.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))  # untouched
