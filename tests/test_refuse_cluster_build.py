"""A cluster run refused as it builds its jobs is refused as a one-process run is: the
mistakes its settings tell (a zoo model's width, keywords a model does not take, a model on
data of the wrong kind, a batch larger than the data) before any rank starts, and what only
building tells (a model factory that raises) with exit 2, one line and the run directory
left free for the fixed command. A cluster run that ran an iteration keeps its evidence.

The factory and the plugin are defined here at module level: the ranks import this module
by its reference (``test_refuse_cluster_build:raises``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

import accelopt
from accelopt import PluginSpec, hookimpl
from accelopt.config import JobConfig
from accelopt.drivers.cluster import faults
from accelopt.drivers.cluster.launch import never_started
from accelopt.errors import ConfigError, RankFailed, RankRefused, UserError
from accelopt.job.specs import validate_spec
from accelopt.plugin import Registry
from accelopt.runtime.run_dir import CLAIM_FILE

HERE = "test_refuse_cluster_build"
CLUSTER = ["workload=single", "workload.jobs.0.iterations=2", "workload.jobs.0.batch_size=8",
           "workload.jobs.0.dataset=synthetic_vectors", "cluster.mode=allreduce",
           "cluster.workers=2", "cluster.timeout_s=30", "run.profile=false", "run.compare=none"]


def raises(*, input_shape, num_classes) -> nn.Module:
    """A model factory that fails: only building the job can tell."""
    raise RuntimeError("boom in the factory")


def takes_hidden(*, input_shape, num_classes, hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], hidden), nn.ReLU(),
                         nn.Linear(hidden, num_classes))


@pytest.mark.parametrize(("settings", "said"), [
    ({"model": "mlp", "width": 0}, r"width must be >= 1 \(or null"),
    ({"model": "mlp", "width": -3}, r"width must be >= 1"),
    ({"model": "mlp", "model_kwargs": {"hidden": 8}}, r"model_kwargs .* zoo model 'mlp'"),
    ({"model": "mlp", "dataset_kwargs": {"n": 8}}, r"dataset_kwargs .* zoo dataset"),
    ({"model": "resnet", "dataset": "synthetic_vectors"},
     r"model 'resnet' needs image data.*choose dataset=synthetic_images"),
    ({"model": "lstm", "dataset": "synthetic_images"}, r"model 'lstm' needs sequence data"),
    ({"model": "mlp", "batch_size": 5000}, r"batch_size=5000 is larger than the training set"),
    ({"model": f"{HERE}:takes_hidden", "dataset": "synthetic_vectors",
      "model_kwargs": {"hiden": 8}}, r"model '.*' cannot be called with hiden: it takes no keyword 'hiden' .*set model_kwargs"),
])
def test_a_job_building_would_refuse_is_refused_with_its_settings(settings, said):
    with pytest.raises(ConfigError, match=rf"^job 'j': {said}"):
        validate_spec(JobConfig(name="j", **settings))


@pytest.mark.parametrize("settings", [
    {"model": "mlp", "dataset": "synthetic_images"}, {"model": "mlp", "dataset": "digits"},
    {"model": "mlp", "kind": "infer", "batch_size": 5000},
    {"model": f"{HERE}:takes_hidden", "dataset": "synthetic_vectors",
     "model_kwargs": {"hidden": 4}},
])
def test_jobs_that_build_are_not_refused(settings):
    validate_spec(JobConfig(name="j", **settings))


@pytest.mark.timeout(60)
def test_a_cluster_job_mistake_is_refused_before_any_rank_starts(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^job '\w+': model 'resnet' needs image data"):
        accelopt.run([*CLUSTER, "workload.jobs.0.model=resnet"], run_dir=out)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.timeout(120)
def test_a_cluster_run_refused_as_its_ranks_build_leaves_its_directory_free(tmp_path):
    """The ranks build the jobs: a factory raising there stopped the run with metrics.json,
    trace.json and timeline.png kept, and the fixed command was refused in that directory
    ("already holds a run")."""
    out = tmp_path / "run"
    with pytest.raises(RankRefused, match=r"raised RuntimeError: boom in the factory") as info:
        accelopt.run([*CLUSTER, f"workload.jobs.0.model={HERE}:raises"], run_dir=out)
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not {"metrics.json", "trace.json", "timeline.png", "config.yaml",
                CLAIM_FILE} & set(left), left
    record = accelopt.run(CLUSTER, run_dir=out)  # fixed: it runs where the refused one did
    assert record.jobs[0].status == "done" and (out / "metrics.json").is_file()


class RefusesAfterOne:
    """Refuses (bad input, a UserError) once the first iteration has run."""

    def __init__(self, config: object = None) -> None:
        self.config = config

    @hookimpl
    def accelopt_iteration_end(self, context, result):
        if context.iteration >= 1:
            raise UserError("refuses-after-one: refused mid-run")


REFUSES = PluginSpec(name="refuses_after_one", factory=RefusesAfterOne,
                     description="refuses after the first iteration (test)")


@pytest.mark.timeout(120)
def test_a_cluster_run_refused_after_an_iteration_keeps_its_evidence(tmp_path):
    registry = Registry.discover()
    registry.add(REFUSES)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="refused mid-run"):
        accelopt.run([*CLUSTER, "workload.jobs.0.iterations=4", "+plugins=[refuses_after_one]"],
                     run_dir=out, registry=registry)
    assert json.loads((out / "metrics.json").read_text())["jobs"][0]["status"] == "failed"


def _refused() -> RankFailed:
    """A rank's refusal as the launcher's watchdog raises it (exit code 2: a RankRefused)."""
    return RankFailed("job 'j': bad (rank 1, worker, before its first iteration; the cluster "
                      "run was stopped)", rank=1, pid=1, iteration=None, cause="bad",
                      exit_code=2)


def test_never_started_only_when_no_rank_ran_an_iteration(tmp_path: Path):
    work = str(tmp_path)
    for rank in range(2):
        faults.Progress(work, rank)  # each rank's progress, before its first iteration
    assert isinstance(_refused(), RankRefused) and never_started(_refused(), work, 2)
    assert not never_started(RuntimeError("x"), work, 2)  # not bad input
    (tmp_path / "failure-0.json").write_text(json.dumps({"user_error": False,
                                                         "communication": False}))
    assert not never_started(_refused(), work, 2)  # another rank's own failure
    (tmp_path / "failure-0.json").unlink()
    faults.Progress(work, 0).set(0, "00-j", "j")  # rank 0 ran an iteration
    assert not never_started(_refused(), work, 2)


def test_the_zoo_datasets_kinds_known_by_name_are_what_they_build():
    """The settings-only check reads a zoo dataset's input kind and size from its name: a
    dataset whose kind or default size changed would be checked against stale facts."""
    from accelopt.job.specs import ZOO_DATASET_KINDS
    from accelopt.workloads.data import _DEFAULT_N_TRAIN, DATASET_NAMES, build_dataset

    assert set(ZOO_DATASET_KINDS) == set(DATASET_NAMES)
    for name, kind in ZOO_DATASET_KINDS.items():
        built = build_dataset(name, seed=0)
        assert built.input_kind == kind, name
        if name.startswith("synthetic_"):
            assert built.n_train == _DEFAULT_N_TRAIN, name
