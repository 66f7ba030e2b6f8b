"""The training options a job's config offers (AdamW and weight decay, a learning-rate
schedule, gradient clipping, mixed precision): each against the plain PyTorch loop that does
the same, in one process and in a cluster run, and each carried through a checkpoint."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from accelopt.config import JobConfig
from accelopt.errors import ConfigError
from accelopt.job import Job
from accelopt.job.optim import lr_factor

sys.path.insert(0, str(Path(__file__).parent))
from test_cluster import make_cfg  # noqa: E402

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


def spec(**kw) -> JobConfig:
    base = dict(name="opt", model="mlp", width=32, batch_size=16, iterations=6, seed=0)
    return JobConfig(**{**base, **kw})


def reference_loop(s: JobConfig, steps: int) -> tuple[torch.nn.Module, list[float]]:
    """What the options mean, written as a user would in plain PyTorch."""
    job = Job(s, job_id="ref", device=CPU)  # the same model, data and loss; our own loop
    model = job.model
    decay = {} if s.weight_decay is None else {"weight_decay": s.weight_decay}
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=s.lr, momentum=s.momentum, **decay),
           "adam": lambda p: torch.optim.Adam(p, lr=s.lr, **decay),
           "adamw": lambda p: torch.optim.AdamW(p, lr=s.lr, **decay)}[s.optimizer](
        model.parameters())
    lrs = []
    for i in range(steps):
        x, y = job.dataset.batch(i, s.batch_size)
        opt.zero_grad()
        job.loss_fn(model(x), y).backward()
        if s.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        for group in opt.param_groups:
            group["lr"] = s.lr * lr_factor(s, i)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
    return model, lrs


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, **tol) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name, **tol)


@pytest.mark.parametrize("options", [
    dict(optimizer="adamw", lr=1e-2),
    dict(optimizer="adamw", lr=1e-2, weight_decay=0.1),
    dict(optimizer="sgd", lr=0.1, weight_decay=1e-3, lr_schedule="cosine", warmup_iterations=2),
    dict(optimizer="adam", lr=1e-2, lr_schedule="linear", min_lr=1e-3, grad_clip=0.05),
], ids=["adamw", "adamw-decay", "sgd-cosine-warmup", "adam-linear-clip"])
def test_each_option_trains_as_the_plain_pytorch_loop_does(options):
    s = spec(**options)
    job = Job(s, job_id="opt", device=CPU)
    for _ in range(s.iterations):
        job.step()
    model, _ = reference_loop(s, s.iterations)
    assert_same_weights(job.model, model, atol=1e-6, rtol=1e-5)
    if s.optimizer == "adamw":
        assert isinstance(job.optimizer, torch.optim.AdamW)
        expected = 0.01 if s.weight_decay is None else s.weight_decay  # AdamW's own default
        assert job.optimizer.param_groups[0]["weight_decay"] == expected


def test_schedules_warm_up_then_decay_to_min_lr_at_the_last_iteration():
    s = spec(lr=1.0, lr_schedule="cosine", warmup_iterations=4, min_lr=0.1, iterations=14)
    factors = [lr_factor(s, i) for i in range(s.iterations)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == pytest.approx(1.0) and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[3:], factors[4:], strict=False))  # decays
    mid = 4 + (s.iterations - 1 - 4) / 2
    assert lr_factor(s, int(mid)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(
        math.pi * (int(mid) - 4) / 9)))
    linear = spec(lr=1.0, lr_schedule="linear", iterations=5)
    assert [lr_factor(linear, i) for i in range(5)] == pytest.approx([1, 0.75, 0.5, 0.25, 0])
    assert [lr_factor(spec(), i) for i in range(3)] == [1.0, 1.0, 1.0]


def test_clipping_bounds_the_norm_the_optimizer_applies():
    s = spec(optimizer="sgd", lr=1.0, momentum=0.0, grad_clip=1e-3, iterations=1)
    job = Job(s, job_id="clip", device=CPU)
    before = [p.detach().clone() for p in job.model.parameters()]
    job.step()
    step = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, job.model.parameters(),
                                                                   strict=True)])
    assert float(step.norm()) == pytest.approx(1e-3, rel=1e-3)  # lr 1: the step is the gradient


def test_bf16_autocast_trains_and_keeps_fp32_weights():
    s = spec(precision="bf16", optimizer="adam", lr=1e-2, iterations=8)
    job = Job(s, job_id="bf16", device=CPU)
    losses = [job.step().loss for _ in range(s.iterations)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in job.model.parameters())
    fp32 = Job(spec(optimizer="adam", lr=1e-2, iterations=8), job_id="fp32", device=CPU)
    first = fp32.step().loss
    assert first != losses[0] and first == pytest.approx(losses[0], rel=0.02)  # bf16 rounding


def test_options_survive_a_checkpoint_bitwise():
    s = spec(optimizer="adamw", lr=1e-2, weight_decay=0.05, lr_schedule="cosine",
             warmup_iterations=2, grad_clip=0.5, precision="bf16", iterations=8)
    whole = Job(s, job_id="w", device=CPU)
    for _ in range(s.iterations):
        whole.step()
    first = Job(s, job_id="w", device=CPU)
    for _ in range(3):
        first.step()
    state = copy.deepcopy(first.state_dict())
    resumed = Job(s, job_id="w", device=CPU)
    resumed.load_state_dict(state)
    for _ in range(s.iterations - 3):
        resumed.step()
    assert_same_weights(whole.model, resumed.model, atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["ps", "allreduce"])
def test_the_options_train_alike_in_a_cluster_run(tmp_path, mode):
    from accelopt.drivers.cluster import run_cluster

    options = dict(optimizer="adamw", lr=1e-2, weight_decay=0.05, lr_schedule="cosine",
                   warmup_iterations=1, grad_clip=0.05)
    cfg = make_cfg(mode, iterations=4)
    for key, value in options.items():
        OmegaConf.update(cfg, f"workload.jobs.0.{key}", value)
    out = run_cluster(cfg, run_dir=tmp_path)
    s = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), cfg.workload.jobs[0]))
    single = Job(s, job_id="single", device=CPU)
    for _ in range(4):
        single.step()
    for name, param in single.model.named_parameters():
        torch.testing.assert_close(out.state[name], param.detach(), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options, words", [
    (dict(optimizer="lion"), "optimizer must be one of sgd, adam, adamw"),
    (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
    (dict(lr_schedule="step"), "lr_schedule must be one of constant, cosine, linear"),
    (dict(warmup_iterations=-1), "warmup_iterations"),
    (dict(min_lr=1.0, lr=0.1), "min_lr must be in"),
    (dict(grad_clip=0.0), "grad_clip must be > 0"),
    (dict(precision="fp8"), "precision must be one of fp32, bf16, fp16"),
    (dict(precision="fp16"), "fp16 needs CUDA"),
])
def test_bad_options_are_one_line(options, words):
    with pytest.raises(ConfigError, match=words) as info:
        Job(spec(**options), job_id="bad", device=CPU)
    assert "\n" not in str(info.value) and "job 'opt'" in str(info.value)


def test_fp16_in_a_cluster_run_is_refused_before_anything_starts(run_tiny):
    with pytest.raises(ConfigError, match="one process only"):
        run_tiny(overrides=["workload.jobs.0.precision=fp16", "cluster.mode=ps"])


def test_job_specs_are_typed_once_per_workload_and_each_caller_gets_its_own():
    """A run asks for its specs several times; the workload is typed once (the OmegaConf
    merge is the cost), yet each answer is a copy, a changed workload is typed anew, and
    an invalid one is refused every time it is asked."""
    from accelopt.job import job_specs

    def workload(**job):
        return OmegaConf.create({"workload": {"jobs": [
            {"name": "a", "model": "mlp", "batch_size": 8, "iterations": 2, **job}]}})

    first, again = job_specs(workload()), job_specs(workload())
    assert first == again and first[0] is not again[0]
    first[0].iterations = 99
    assert job_specs(workload())[0].iterations == 2
    assert job_specs(workload(iterations=3))[0].iterations == 3
    for _ in range(2):
        with pytest.raises(ConfigError, match="iterations must be >= 1"):
            job_specs(workload(iterations=0))


def test_run_seed_changes_every_jobs_random_numbers(run_tiny):
    """run.seed reached the plugins' RunInfo only: run.seed=0,1,2 trained three identical
    runs recorded as three seeds. It is added to every job's seed."""
    from accelopt.job import job_specs

    cfg = OmegaConf.create({"run": {"seed": 5}, "workload": {"jobs": [
        {"name": "a", "model": "mlp", "batch_size": 8, "iterations": 2, "seed": 1},
        {"name": "b", "model": "mlp", "batch_size": 8, "iterations": 2}]}})
    assert [s.seed for s in job_specs(cfg)] == [6, 5]
    assert [s.seed for s in job_specs(cfg)] == [6, 5]  # the cached specs stay unseeded
    zero, one, again = (run_tiny(overrides=[f"run.seed={seed}", "cluster.mode=none"]).jobs[0]
                        .losses for seed in (0, 1, 1))
    assert zero != one and one == again


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".hidden", "", "tab\there"])
def test_a_job_name_that_would_write_outside_its_files_is_refused(name):
    """The name is part of ``weights/<id>.pt``, the checkpoint and a service's job
    directory: ``../../x`` wrote over another job's results."""
    from accelopt.job import job_specs

    cfg = OmegaConf.create({"workload": {"jobs": [
        {"name": name, "model": "mlp", "batch_size": 8, "iterations": 2}]}})
    with pytest.raises(ConfigError, match="cannot name the job's files") as info:
        job_specs(cfg)
    assert "\n" not in str(info.value)
