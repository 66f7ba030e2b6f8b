"""Per-job random state: a job's dropout masks come from its own generator, so jobs sharing a
process never perturb each other, a plugin's measurement forward does not shift them, and a
checkpoint carries them (resume of a dropout model is bitwise: tests/test_checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accelopt.config import JobConfig
from accelopt.job import Job, JobRandom, isolated_rng

pytestmark = pytest.mark.timeout(240)
DROPOUT = "dropout_models:dropout_mlp"


def job_list(*names: str) -> str:
    jobs = {
        "a": f"{{name: a, model: '{DROPOUT}', dataset: synthetic_vectors, width: 16, "
             "batch_size: 8, iterations: 5, seed: 3}",
        "c": f"{{name: c, model: '{DROPOUT}', dataset: synthetic_vectors, width: 16, "
             "batch_size: 8, iterations: 4, seed: 4}",
        "b": "{name: b, model: mlp, width: 16, batch_size: 8, iterations: 3, seed: 5}",
    }
    return "workload.jobs=[" + ", ".join(jobs[n] for n in names) + "]"


def weights(record, name: str) -> dict[str, torch.Tensor]:
    job = next(j for j in record.jobs if j.job.name == name)
    assert job.status == "done", job.error
    path = Path(record.info.run_dir) / "weights" / f"{job.job.job_id}.pt"
    return torch.load(path, weights_only=True)


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_the_stream_belongs_to_the_job_not_to_the_process(run_tiny):
    # the job's seed alone decides its stream: run.seed is added to it (3 + 0 = 2 + 1)
    first = run_tiny(overrides=[job_list("a"), "run.threads=1", "run.seed=0"])
    other_seed = run_tiny(overrides=[job_list("a").replace("seed: 3", "seed: 2"),
                                     "run.threads=1", "run.seed=1"])
    assert_bitwise(weights(first, "a"), weights(other_seed, "a"))
    # and the model really draws: another job seed gives other masks (and other weights)
    reseeded = run_tiny(overrides=[job_list("a").replace("seed: 3", "seed: 9"), "run.threads=1"])
    assert not torch.equal(weights(first, "a")["1.weight"], weights(reseeded, "a")["1.weight"])


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Each dropout job trained alone (one thread): its final weights."""
    from accelopt.testing import run_workload

    out = {}
    for name in ("a", "c"):
        record = run_workload([], [job_list(name), "run.threads=1"],
                              tmp_path=tmp_path_factory.mktemp(f"alone-{name}"))
        out[name] = weights(record, name)
    return out


@pytest.mark.parametrize("policy", [None, "fifo", "pack", "srtf", "fair", "rr"])
def test_a_dropout_job_next_to_others_ends_bitwise_equal_to_alone(run_tiny, alone, policy):
    """Alone vs next to another dropout job and a plain one, all ready at once, under FIFO
    (no plugin) and every salus policy (one thread per lane, as alone)."""
    from accelopt_plugins.salus import PLUGIN as SALUS

    plugins = () if policy is None else (SALUS,)
    salus = [] if policy is None else [f"plugins.salus.policy={policy}", "plugins.salus.threads=1",
                                       "plugins.salus.capacity=1GiB"]
    together = run_tiny(*plugins, overrides=[job_list("c", "a", "b"), "run.threads=1", *salus])
    assert [j.status for j in together.jobs] == ["done"] * 3
    assert_bitwise(alone["a"], weights(together, "a"))
    assert_bitwise(alone["c"], weights(together, "c"))


def test_a_gpu_kernels_measurement_forward_does_not_shift_the_masks(run_tiny):
    """gpu_kernels' channels_last=auto times training steps of the model inside its first
    forward; the job's random state after training is the same as without the plugin (same
    number of draws: its dropout acts on flattened features, whatever the layout)."""
    from accelopt_plugins.gpu_kernels import PLUGIN as GPU_KERNELS

    job = ("workload.jobs=[{name: k, model: 'dropout_models:dropout_cnn', "
           "dataset: synthetic_images, width: 4, batch_size: 4, iterations: 2, seed: 2}]")
    common = [job, "run.threads=1", "run.checkpoint_every=1"]
    plain = run_tiny(overrides=common)
    measured = run_tiny(GPU_KERNELS, overrides=[*common, "plugins.gpu_kernels.channels_last=auto",
                                                "plugins.gpu_kernels.autotune_reps=3"])
    row = next(r for r in measured.plugin_rows if r.plugin == "gpu_kernels")
    assert "channels_last" in row.summary  # it did measure

    def random_state(record):
        path = next((Path(record.info.run_dir) / "checkpoints").glob("*.pt"))
        return torch.load(path, weights_only=False)["job"]["random"]["cpu"]

    assert torch.equal(random_state(plain), random_state(measured))


def test_concurrent_random_jobs_serialise_only_while_they_draw():
    """The first step tells whether a job draws; one that does not never takes the lock."""
    plain = Job(JobConfig(name="p", model="mlp", width=8, batch_size=4, iterations=2),
                job_id="p", device=torch.device("cpu"))
    drawing = Job(JobConfig(name="d", model=DROPOUT, dataset="synthetic_vectors", width=8,
                            batch_size=4, iterations=2), job_id="d", device=torch.device("cpu"))
    assert plain.random.uses_rng is None and drawing.random.uses_rng is None
    plain.step()
    drawing.step()
    assert plain.random.uses_rng is False and drawing.random.uses_rng is True


def test_isolated_rng_leaves_the_job_stream_where_it_was():
    rng = JobRandom(seed=1, device=torch.device("cpu"))
    with rng.active():
        with isolated_rng():
            torch.rand(100)  # a measurement's draws
        kept = torch.rand(3)
    fresh = JobRandom(seed=1, device=torch.device("cpu"))
    with fresh.active():
        assert torch.equal(torch.rand(3), kept)


def test_the_process_generator_is_untouched_by_a_jobs_step():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    job = Job(JobConfig(name="d", model=DROPOUT, dataset="synthetic_vectors", width=8,
                        batch_size=4, iterations=2), job_id="d", device=torch.device("cpu"))
    job.step()
    assert torch.equal(torch.get_rng_state(), before)
