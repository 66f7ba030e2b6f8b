"""Checkpoints of cluster runs: every rank saves its own part; a rank SIGKILLed mid-run, then
``run.resume`` into a new directory, reaches the weights of an uninterrupted run bit for bit
(deterministic settings), in PS and in all-reduce mode, and leaves the killed run's files as
they were."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from clirun import accelopt_cmd, cli_env, run_files, run_in_process, saved_weights

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
    assert proc.returncode == 1, stderr.decode()[-2000:]
    assert not (run_dir / "weights").exists(), "the run finished before it was killed"
    killed = json.loads((run_dir / "metrics.json").read_text())  # the evidence is kept
    assert killed["summary"]["error"] and killed["jobs"][0]["status"] == "failed"

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
