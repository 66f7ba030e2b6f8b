"""Checkpoints at iteration boundaries: atomic, and a killed run resumes to the same weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from clirun import (
    accelopt,
    accelopt_cmd,
    accelopt_in_process,
    cli_env,
    run_files,
    run_in_process,
    saved_weights,
)

from accelopt.job.checkpoint import atomic_torch_save

JOB = [
    "workload=single",
    "workload.jobs.0.iterations=1500",
    "workload.jobs.0.width=64",
    "run.threads=1",
    "run.progress=false",
    "run.checkpoint_every=25",
]



def _wait_for(predicate, proc: subprocess.Popen, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"run ended (rc={proc.returncode}) before the condition held")
        if time.monotonic() > end:
            pytest.fail("condition not reached in time")
        time.sleep(0.005)  # polling a file, not synchronising threads


DROPOUT = ["workload.jobs.0.model=dropout_models:dropout_mlp",
           "workload.jobs.0.dataset=synthetic_vectors"]
"""A model with dropout: its masks come from the job's own generator, which the checkpoint
carries, so resuming it is bitwise too."""


PRUNED = ["+plugins=[gpu_kernels]", "plugins.gpu_kernels.prune_amount=0.5",
          "plugins.gpu_kernels.prune_at_iteration=10"]
"""Pruned after 10 iterations, before the first checkpoint: the resume builds the job dense
and gpu_kernels prunes the same units from its state in the checkpoint before the weights
load."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("model", [[], DROPOUT, PRUNED], ids=["mlp", "dropout", "pruned"])
def test_sigkill_then_resume_reaches_the_samesaved_weights(tmp_path, model):
    job = [*JOB, *model]
    ref_dir = tmp_path / "reference"
    run_in_process(*job, run_dir=ref_dir)  # the uninterrupted run

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(
        accelopt_cmd("run", *job, f"hydra.run.dir={run_dir}"),
        cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        ckpt = run_dir / "checkpoints"
        _wait_for(lambda: ckpt.is_dir() and any(ckpt.glob("*.pt")), proc, 120)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "weights").exists(), "the run finished before it could be killed"
    state = torch.load(next(ckpt.glob("*.pt")), weights_only=False)
    assert 0 < state["job"]["iteration"] < 1500
    assert state["job"]["random"]["uses_rng"] is (model is DROPOUT)  # dropout draws
    assert ("gpu_kernels" in state["job"]["plugins"]) is (model is PRUNED)

    before = run_files(run_dir)
    new_dir = tmp_path / "resumed"  # the command line of a resume: test_resume_of_a_finished...
    run_in_process(f"run.resume={run_dir}", "run.progress=false", run_dir=new_dir)
    assert run_files(run_dir) == before, "the resumed run wrote into the original directory"
    ref, got = saved_weights(ref_dir), saved_weights(new_dir)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key  # bitwise
    metrics = json.loads((new_dir / "metrics.json").read_text())
    assert metrics["summary"]["resumed_from"] == str(run_dir)
    (job,) = metrics["jobs"]
    assert job["iterations"] == 1500 and job["status"] == "done"
    # the part before the kill counts: the job arrived on the resumed run's clock as long
    # before its start as the old run had got (its newest checkpoint's clock), so its JCT,
    # arrival to end, counts it
    stopped_at = max(torch.load(p, weights_only=False)["timing"]["clock_s"]
                     for p in ckpt.glob("*.pt"))
    assert stopped_at > 0
    assert job["arrival_s"] == pytest.approx(-stopped_at)
    assert job["jct_s"] == pytest.approx(job["end_s"] - job["arrival_s"])
    assert metrics["summary"]["makespan_s"] == pytest.approx(job["jct_s"])



@pytest.mark.timeout(120)
def test_resume_of_a_finished_run_is_refused_unless_asked_and_never_rewrites_it(tmp_path,
                                                                              capfd):
    """Every command in this process (``cli.main.main``: its exit codes, lines and the files
    it leaves are what is checked; an interpreter's start per command is not)."""
    job = ["workload=single", "workload.jobs.0.iterations=20", "workload.jobs.0.width=16",
           "run.progress=false", "run.checkpoint_every=5"]
    first = tmp_path / "first"
    run_in_process(*job, run_dir=first)
    before = run_files(first)

    def accelopt_run(*args: str):
        return accelopt_in_process("run", *args, cwd=tmp_path, capfd=capfd)

    refused = accelopt_run(f"run.resume={first}", f"hydra.run.dir={tmp_path / 'again'}")
    assert refused.returncode == 2
    assert "already finished (all 1 job(s) done)" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "again" / "metrics.json").exists()
    same_dir = accelopt_run(f"run.resume={first}", f"hydra.run.dir={first}",
                            "run.resume_finished=true")
    assert same_dir.returncode == 2 and "writes into a new directory" in same_dir.stderr
    again = tmp_path / "reported"
    asked = accelopt_run(f"run.resume={first}", "run.resume_finished=true",
                         f"hydra.run.dir={again}", "run.progress=false")
    assert asked.returncode == 0, asked.stderr
    assert "resuming" in asked.stdout
    assert run_files(first) == before
    old = json.loads((first / "metrics.json").read_text())["jobs"][0]
    new = json.loads((again / "metrics.json").read_text())["jobs"][0]
    assert new["status"] == "done" and new["iterations"] == 20
    assert new["jct_s"] == pytest.approx(old["jct_s"]) and new["final_loss"] == old["final_loss"]
    # a resume runs the old run's configuration: overrides it would drop are refused
    changed = accelopt_run(f"run.resume={first}", "run.resume_finished=true",
                           "workload=tiny", "+plugins=[noop]")
    assert changed.returncode == 2 and changed.stderr.strip().splitlines() == [
        f"error: run.resume continues {first} with the configuration it ran with, so "
        "workload=tiny, +plugins=[noop] would be ignored; drop them (a new run takes them)"]
    # a plugin's option alone: the same refusal, not composing's "add +plugins=[noop]"
    # (which the resume would then refuse)
    option = accelopt_run(f"run.resume={first}", "run.resume_finished=true",
                          "plugins.noop.record=false")
    assert option.returncode == 2 and "plugins.noop.record=false would be ignored; drop it" \
        in option.stderr, option.stderr
    assert run_files(first) == before


@pytest.mark.timeout(120)
def test_a_resumed_runs_finished_jobs_keep_their_times_and_the_makespan(tmp_path):
    """A job finished before the resume ended at its arrival with its JCT carried: its row
    ended before it started, and the makespan moved its start back instead of its end
    forward (0.118 s for a run whose second job arrived at 0.05 s and took 0.080 s)."""
    first, again = tmp_path / "first", tmp_path / "again"
    run_in_process("workload=tiny", "run.progress=false", "run.compare=none",
                   "run.checkpoint_every=2", run_dir=first)
    run_in_process(f"run.resume={first}", "run.resume_finished=true", "run.progress=false",
                   run_dir=again)
    old, new = (json.loads((d / "metrics.json").read_text()) for d in (first, again))
    assert new["summary"]["makespan_s"] == pytest.approx(old["summary"]["makespan_s"])
    assert new["summary"]["makespan_s"] >= max(j["arrival_s"] + j["jct_s"] for j in old["jobs"])
    for before, after in zip(old["jobs"], new["jobs"], strict=True):
        assert after["jct_s"] == pytest.approx(before["jct_s"])
        assert after["end_s"] - after["arrival_s"] == pytest.approx(after["jct_s"])
        assert after["queueing_s"] == pytest.approx(before["queueing_s"])
        assert after["first_start_s"] - after["arrival_s"] == pytest.approx(after["queueing_s"])


@pytest.mark.timeout(120)
def test_a_resume_whose_checkpoints_are_of_other_jobs_writes_nothing(tmp_path):
    """Refused in one line, after the new directory held the carried checkpoints, the config
    and the log (the refusal is found before anything is written)."""
    first = tmp_path / "first"
    run_in_process("workload=single", "workload.jobs.0.iterations=4", "run.progress=false",
                   "run.checkpoint_every=2", run_dir=first)
    config = (first / "config.yaml").read_text()
    assert "lr: 0.05" in config
    (first / "config.yaml").write_text(config.replace("lr: 0.05", "lr: 0.07"))
    refused = accelopt("run", f"run.resume={first}", "run.resume_finished=true",
                       f"hydra.run.dir={tmp_path / 'again'}", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "was written for a different job spec" in refused.stderr
    assert "resuming" not in refused.stdout
    assert not (tmp_path / "again").exists()


def test_resume_of_a_directory_without_a_run_is_one_line(tmp_path):
    result = accelopt("run", f"run.resume={tmp_path}", cwd=tmp_path)
    assert result.returncode == 2
    assert "has no config.yaml" in result.stderr
    missing = accelopt("run", f"run.resume={tmp_path / 'nowhere'}", cwd=tmp_path)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "x.pt"
    atomic_torch_save({"a": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError):
        atomic_torch_save({"a": Unpicklable()}, path)
    assert torch.load(path, weights_only=False) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_each_plugins_state_goes_back_to_it_and_an_orphan_state_is_refused():
    """``accelopt_state_save`` / ``_load`` through the job's checkpoint state: each plugin
    gets its own state back after run_start; the state of a plugin that is not active is a
    one-line refusal, not a silent loss."""
    from accelopt import PluginSpec, UserError, hookimpl
    from accelopt.activation import PluginSet
    from accelopt.config import JobConfig
    from accelopt.job import Job

    class Counter:
        def __init__(self, _config=None) -> None:
            self.seen = 0
            self.loaded = None

        @hookimpl
        def accelopt_iteration_end(self, context, result):
            self.seen += 1

        @hookimpl
        def accelopt_state_save(self, job):
            return {"seen": self.seen}

        @hookimpl
        def accelopt_state_load(self, job, state):
            self.loaded = state

    spec = JobConfig(name="s", model="mlp", width=8, batch_size=8, iterations=3, seed=0)
    counter = Counter()
    plugins = PluginSet.of([(PluginSpec(name="counter", factory=Counter), counter)])
    job = Job(spec, job_id="s", device=torch.device("cpu"), host=plugins.for_job("s"))
    from accelopt.job import StepEvents

    events = StepEvents(job.host)
    for _ in range(2):
        job.step(events)
    state = job.state_dict()
    assert state["plugins"] == {"counter": {"seen": 2}}
    fresh = Counter()
    again = Job(spec, job_id="s", device=torch.device("cpu"),
                host=PluginSet.of([(PluginSpec(name="counter", factory=Counter),
                                    fresh)]).for_job("s"))
    again.load_state_dict(state)
    assert fresh.loaded is None  # not before the run has started
    again.restore_plugin_states()
    assert fresh.loaded == {"seen": 2}
    orphan = Job(spec, job_id="s", device=torch.device("cpu"))
    orphan.load_state_dict(state)
    with pytest.raises(UserError, match="plugin 'counter', which is not active") as info:
        orphan.restore_plugin_states()
    assert "\n" not in str(info.value)


def test_a_plugin_state_torch_save_cannot_write_names_the_plugin_and_key(tmp_path):
    """A lambda in a plugin's saved state ended the run with pickle's traceback, naming
    neither the plugin nor the key; the checkpoint before it stays."""
    from accelopt import PluginHookError, PluginSpec, hookimpl
    from accelopt.activation import PluginSet
    from accelopt.config import JobConfig
    from accelopt.job import Job
    from accelopt.job.checkpoint import save_checkpoint

    class Keeps:
        def __init__(self, _config=None) -> None:
            self.state = {"n": 1}

        @hookimpl
        def accelopt_state_save(self, job):
            return self.state

    keeps = Keeps()
    spec = JobConfig(name="s", model="mlp", width=8, batch_size=8, iterations=3, seed=0)
    job = Job(spec, job_id="s", device=torch.device("cpu"),
              host=PluginSet.of([(PluginSpec(name="keeps", factory=Keeps), keeps)]).for_job("s"))
    path = tmp_path / "s.pt"
    save_checkpoint({"job": job.state_dict()}, path)
    keeps.state = {"n": 2, "f": lambda: 1}
    with pytest.raises(PluginHookError, match="plugin 'keeps' answered accelopt_state_save with "
                       "dict .*; expected a dict torch.save can write .*; key 'f': "
                       "AttributeError: Can't pickle local object") as info:
        save_checkpoint({"job": job.state_dict()}, path)
    assert info.value.hook == "accelopt_state_save" and "\n" not in str(info.value)
    assert torch.load(path, weights_only=False)["job"]["plugins"] == {"keeps": {"n": 1}}


@pytest.mark.parametrize(("files", "words"), [
    (["checkpoints/00-mlp.pt"], "from its checkpoints"),
    (["checkpoints/00-mlp/rank1.it00000060.pt"], "from its checkpoints"),  # a cluster run's
    ([], "it wrote no checkpoint"),
])
def test_the_resume_line_says_whether_there_is_a_checkpoint(tmp_path, files, words):
    """A cluster run's checkpoints (one folder per job) read as 'it wrote no checkpoint ...
    start from the beginning' while the run did resume from iteration 60."""
    import io

    from omegaconf import OmegaConf
    from rich.console import Console

    from accelopt.config import AccelConfig, JobConfig
    from accelopt.runtime.run import _maybe_resume

    old = tmp_path / "old"
    old.mkdir()
    saved = OmegaConf.structured(AccelConfig)
    saved.workload.jobs = [JobConfig(name="other")]  # not 00-mlp: no spec of its own to compare
    OmegaConf.save(saved, old / "config.yaml")
    for name in files:
        (old / name).parent.mkdir(parents=True, exist_ok=True)
        torch.save({}, old / name)  # readable (an empty file is refused: test_resume_edges)
    cfg = OmegaConf.structured(AccelConfig)
    cfg.run.resume = str(old)
    out = io.StringIO()
    _maybe_resume(cfg, tmp_path / "new", Console(file=out, width=300))
    assert words in out.getvalue()


@pytest.mark.timeout(120)
def test_a_resume_writes_the_weights_of_jobs_that_had_finished_before_it(tmp_path):
    """Jobs restored as done never reached the code that writes weights/, so the resumed
    run's directory held only the weights of the jobs it trained itself."""
    first = tmp_path / "first"
    run_in_process("workload=tiny", "cluster.mode=none", "run.checkpoint_every=2",
                   "run.progress=false", run_dir=first)
    weights = {p.name: torch.load(p, weights_only=True) for p in (first / "weights").glob("*.pt")}
    assert len(weights) == 2
    (first / "metrics.json").unlink()  # as if killed after both checkpoints, before the end
    new = tmp_path / "resumed"
    run_in_process(f"run.resume={first}", "run.progress=false", run_dir=new)
    for name, state in weights.items():
        got = torch.load(new / "weights" / name, weights_only=True)
        assert all(torch.equal(got[k], v) for k, v in state.items()), name


@pytest.mark.timeout(120)
def test_a_sigterm_stops_every_lane_so_the_checkpoints_stay_resumable(run_tiny, tmp_path):
    """SIGTERM reaches the main thread, waiting for the lanes: they stop after their current
    iteration too. Before, they trained on after the run had written its evidence, and their
    next checkpoint saved the job as failed (the evidence's status), which a resume counts
    as ended and never continues."""
    import threading

    from accelopt import PluginSpec, hookimpl
    from accelopt.errors import Terminated, raise_terminated

    class StopAt:
        def __init__(self, _config=None) -> None:
            self.fired = False

        @hookimpl
        def accelopt_iteration_end(self, context, result):
            if context.iteration == 3 and not self.fired:
                self.fired = True
                os.kill(os.getpid(), signal.SIGTERM)

    spec = PluginSpec(name="stop_at", factory=StopAt)
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with pytest.raises(Terminated):
            run_tiny(spec, overrides=["+plugins=[stop_at]", "run.checkpoint_every=1",
                                      "cluster.mode=none", "workload.jobs.0.iterations=400"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("lane-")]
    (run_dir,) = tmp_path.glob("run*")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    first = metrics["jobs"][0]
    assert first["status"] == "failed" and "terminated" in first["error"]
    saved = torch.load(run_dir / "checkpoints" / f"{first['job_id']}.pt", weights_only=False)
    assert saved["result"]["status"] not in ("failed", "done")  # a resume continues it
    assert saved["job"]["iteration"] == first["iterations"] < 400  # nothing trained after
