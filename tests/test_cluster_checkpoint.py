"""Checkpoints of cluster runs: every rank saves its own part; a rank SIGKILLed mid-run, then
``run.resume`` into a new directory, reaches the weights of an uninterrupted run bit for bit
(deterministic settings), in PS and in all-reduce mode, and leaves the killed run's files as
they were."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from clirun import accelopt_cmd, cli_env, run_files, run_in_process, saved_weights
from rich.console import Console

import accelopt
from accelopt import hookimpl

ITERATIONS = 150
JOB = ["workload=single", f"workload.jobs.0.iterations={ITERATIONS}", "workload.jobs.0.width=64",
       "run.threads=1", "run.progress=false", "run.checkpoint_every=10", "cluster.timeout_s=20"]
WORKERS = {"ps": 1, "allreduce": 2}
"""PS: one worker and one server (the server holds the parameters and the optimizer);
all-reduce: two replicas. Two processes either way, so the test stays short."""


def _rank_pids(launcher: int) -> list[int]:
    """The rank processes of a run: forked by the launcher's forkserver (or, where the
    platform has none, spawned by the launcher itself)."""
    parent: dict[int, int] = {}
    cmdline: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline[int(entry.name)] = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
    servers = {p for p, pp in parent.items() if pp == launcher and b"forkserver" in cmdline[p]}
    return sorted(p for p, pp in parent.items()
                  if pp in servers or (pp == launcher and b"spawn_main" in cmdline[p]))




@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["ps", "allreduce", "allreduce+gradcomm"])
def test_a_killed_rank_resumes_to_the_samesaved_weights(tmp_path, mode):
    """``allreduce+gradcomm``: top-k sparsified gradients with error feedback, whose
    residuals (the plugin's state, ``accelopt_state_save``) the resumed ranks need to
    continue bit for bit."""
    mode, _, plugin = mode.partition("+")
    job = [*JOB, f"cluster.mode={mode}", f"cluster.workers={WORKERS[mode]}"]
    if plugin:
        job += ["+plugins=[gradcomm]", "plugins.gradcomm.sparsify=topk",
                "plugins.gradcomm.density=0.05"]
    ref_dir = tmp_path / "reference"
    run_in_process(*job, run_dir=ref_dir)  # the uninterrupted run

    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(accelopt_cmd("run", *job, f"hydra.run.dir={run_dir}"), cwd=tmp_path,
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        ranks = 2
        while len({p.name.split(".")[0] for p in run_dir.glob("checkpoints/*/rank*.it*.pt")}) \
                < ranks:
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint from every rank in time"
            time.sleep(0.005)  # polling files, not synchronising threads
        victim = _rank_pids(proc.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, stderr.decode()[-2000:]  # jobs unfinished: a dead worker
    assert not (run_dir / "weights").exists(), "the run finished before it was killed"
    killed = json.loads((run_dir / "metrics.json").read_text())  # the evidence is kept
    assert killed["summary"]["error"] and killed["jobs"][0]["status"] == "failed"
    # the ranks still running left their timelines up to the stop (the trace held nothing)
    note = killed["telemetry"]["note"]
    assert note.startswith("the cluster run failed: trace.json holds the timelines of "), note
    assert re.search(r"; rank \d left none \(killed, or stuck\)$", note), note
    trace = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    named = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert len(named) == 1, named  # of the two ranks, the one the kill left running
    assert any(e.get("ph") == "X" for e in trace)

    before = run_files(run_dir)
    new_dir = tmp_path / "resumed"
    run_in_process(f"run.resume={run_dir}", run_dir=new_dir)
    assert run_files(run_dir) == before, "the resumed run wrote into the killed run's directory"
    ref, got = saved_weights(ref_dir), saved_weights(new_dir)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key  # bitwise
    metrics = json.loads((new_dir / "metrics.json").read_text())
    (result,) = metrics["jobs"]
    assert result["status"] == "done" and result["iterations"] == ITERATIONS
    assert metrics["summary"]["resumed_from"] == str(run_dir)
    assert result["jct_s"] > 0
    # the carried iterations count in the samples, their service time in the throughput's
    # denominator, and the makespan holds the JCT that counts the part before the kill
    latest = max(int(p.name.split(".it")[1][:-3]) for p in run_dir.glob("checkpoints/*/*.pt"))
    carried = max(torch.load(p, weights_only=False)["service_s"]
                  for p in run_dir.glob(f"checkpoints/*/rank*.it{latest:08d}.pt"))
    assert carried > 0
    assert result["samples"] / result["throughput"] > carried
    assert metrics["summary"]["makespan_s"] >= result["jct_s"]
    # the queueing delay before the kill is the job's (it was the resumed part's own)
    queued = [torch.load(p, weights_only=False)["queueing_s"]
              for p in run_dir.glob(f"checkpoints/*/rank*.it{latest:08d}.pt")]
    assert any(result["queueing_s"] == pytest.approx(q) for q in queued if q is not None)


TESTS = str(Path(__file__).parent)
CHAIN = ["workload=single", "workload.jobs.0.iterations=40", "workload.jobs.0.width=16",
         "run.threads=1", "run.progress=false", "run.checkpoint_every=10", "run.compare=none"]


class _StopsAfter15:
    """Raises in its 16th ``accelopt_iteration_end`` of a process (iteration 15 of a fresh
    run, 25 of one resumed at 10): a plugin's error stops a one-process run."""

    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def accelopt_iteration_end(self, context, result) -> None:
        self.calls += 1
        if self.calls > 15:
            raise ValueError(f"stop at call {self.calls}")


def _failing_at_start(*_args, **_kwargs):
    raise RuntimeError("failed at start")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["none", "ps"])
def test_a_resumed_run_that_failed_at_start_is_resumed_from_the_checkpoint_it_started_from(
        tmp_path, monkeypatch, mode):
    """A stops at iteration 15 (a checkpoint at 10); B resumes A and fails at start, before
    its own first checkpoint; C resumes B (the latest directory). C must continue from A's
    iteration 10: it stops again 15 iterations later, at 25, having written the checkpoint of
    iteration 20. Before, B's directory held no checkpoint, so C started from 0."""
    from accelopt.plugin import PluginSpec, Registry

    registry = Registry.discover()
    if mode == "none":  # one process: a plugin's error stops the run
        registry.add(PluginSpec(name="stops15", factory=lambda c: _StopsAfter15(),
                                description="stops the run (test)"))
        job = [*CHAIN, "cluster.mode=none", "+plugins=[stops15]"]
        fail_at_start = ("accelopt.runtime.run.Executor.run", _failing_at_start)
        stops = ("stop at call 16", "stop at call 16")  # C's iteration: its checkpoint's
    else:  # a cluster: a rank's model raising stops the run
        monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
        job = [*CHAIN, "cluster.mode=ps", "cluster.workers=1", "cluster.timeout_s=20",
               "workload.jobs.0.model=byo_models:raises_after",
               "workload.jobs.0.dataset=synthetic_vectors",
               "workload.jobs.0.model_kwargs={after:15}"]
        fail_at_start = ("accelopt.drivers.cluster.run_cluster", _failing_at_start)
        stops = ("at iteration 15", "at iteration 25")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    with pytest.raises(Exception, match=stops[0]):
        accelopt.run(job, run_dir=a, registry=registry)
    with monkeypatch.context() as patch:
        patch.setattr(*fail_at_start)
        with pytest.raises(RuntimeError, match="failed at start"):
            accelopt.run([f"run.resume={a}"], run_dir=b, registry=registry)
    out = io.StringIO()
    with pytest.raises(Exception, match=stops[1]):
        accelopt.run([f"run.resume={b}"], run_dir=c, registry=registry,
                     console=Console(file=out, width=300))
    assert f"resuming {b} from its checkpoints" in out.getvalue()
    (job_id,) = json.loads((c / "metrics.json").read_text())["jobs"]
    assert job_id["status"] == "failed"
    if mode == "none":
        state = torch.load(next((c / "checkpoints").glob("*.pt")), weights_only=False)
        assert state["job"]["iteration"] == 20
    else:
        assert job_id["iterations"] == 25  # the failing rank's progress
        assert {p.name for p in c.glob("checkpoints/*/*.pt")} == {
            "rank0.it00000010.pt", "rank1.it00000010.pt",
            "rank0.it00000020.pt", "rank1.it00000020.pt"}
    assert {p.name for p in a.glob("checkpoints/**/*.pt")} == {
        p.name for p in b.glob("checkpoints/**/*.pt")}  # B holds what it started from


def test_a_resume_honours_the_rendezvous_port_and_the_timeout(tmp_path):
    """A run whose fixed port is now taken, or whose timeout was too short, can be resumed
    with another (neither changes the numerics or the checkpoints); other settings stay
    refused, and what is not given stays the old run's."""
    from omegaconf import OmegaConf

    from accelopt.cli.hydra_run import refuse_bad_resume
    from accelopt.config import AccelConfig, JobConfig
    from accelopt.errors import ConfigError
    from accelopt.runtime.run import _maybe_resume

    old = tmp_path / "old"
    old.mkdir()
    saved = OmegaConf.structured(AccelConfig)
    saved.cluster.master_port, saved.cluster.timeout_s = 29590, 7.0
    saved.workload.jobs = [JobConfig()]  # a run's config has a workload
    OmegaConf.save(saved, old / "config.yaml")
    given = [f"run.resume={old}", "cluster.master_port=0", "cluster.timeout_s=90"]
    refuse_bad_resume(given)  # not refused
    with pytest.raises(ConfigError, match="run.seed=3 would be ignored"):
        refuse_bad_resume([*given, "run.seed=3"])
    cfg = OmegaConf.structured(AccelConfig)
    cfg.run.resume, cfg.cluster.master_port, cfg.cluster.timeout_s = str(old), 0, 90.0
    console = Console(file=io.StringIO())
    resumed, _ = _maybe_resume(cfg, tmp_path / "new", console, overrides=given)
    assert (resumed.cluster.master_port, resumed.cluster.timeout_s) == (0, 90.0)
    resumed, _ = _maybe_resume(cfg, tmp_path / "new", console, overrides=given[:1])
    assert (resumed.cluster.master_port, resumed.cluster.timeout_s) == (29590, 7.0)


@pytest.mark.timeout(120)
def test_a_single_job_cluster_run_writes_per_iteration_json(tmp_path):
    run_in_process("workload=single", "workload.jobs.0.iterations=4", "workload.jobs.0.width=16",
                   "cluster.mode=ps", "cluster.workers=1", "run.progress=false",
                   "run.compare=none", run_dir=tmp_path / "run")
    rows = json.loads((tmp_path / "run" / "per_iteration.json").read_text())
    assert len(rows) == 4 and {r["iteration"] for r in rows} == {0, 1, 2, 3}
    assert {r["job"] for r in rows} == {json.loads(
        (tmp_path / "run" / "metrics.json").read_text())["jobs"][0]["job_id"]}
    assert all(r["iteration_makespan_s"] > 0 for r in rows)
