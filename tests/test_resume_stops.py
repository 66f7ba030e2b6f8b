"""What a stopped run says of its jobs' weights and scores: a run stopped after its jobs
ended but before their weights were saved points at the resume that saves them, and a job
that had finished in a run stopped mid-way says why it has no score."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal

import pytest
import torch
from clirun import run_in_process
from rich.console import Console

from accelopt import PluginSpec, hookimpl

pytestmark = pytest.mark.timeout(120)


def test_a_run_stopped_before_its_weights_were_saved_says_how_to_save_them(tmp_path):
    """A ps run stopped (Ctrl-C) once its jobs had ended, while its ranks handed over the
    weights: every output written, no weights/, no score, and the line said "nothing to
    resume" where ``run.resume_finished=true`` saves them from the final checkpoints. (The
    directory is made here from a one-process run's, less its weights: the same files.)"""
    from accelopt.cli.hydra_run import stopped_line

    run_dir = tmp_path / "run"
    run_in_process("workload=tiny", "cluster.mode=none", "run.compare=none",
                   "run.progress=false", "run.checkpoint_every=2", run_dir=run_dir)
    saved = {p.name: torch.load(p, weights_only=True) for p in (run_dir / "weights").iterdir()}
    shutil.rmtree(run_dir / "weights")
    line = stopped_line("interrupted (Ctrl-C)", run_dir)
    assert line == (
        "interrupted (Ctrl-C) after its jobs ended (all 2 job(s) done), before their weights "
        f"were saved: {run_dir} holds metrics.json, metrics.csv, trace.json, timeline.png, "
        "not weights/00-tiny-mlp.pt, weights/01-tiny-cnn.pt, and its jobs were not scored; "
        "save the weights and score the jobs from its checkpoints with: accelopt run "
        f"run.resume={run_dir} run.resume_finished=true")
    again = tmp_path / "again"  # what the line says to run gives them back, bit for bit
    record = run_in_process(f"run.resume={run_dir}", "run.resume_finished=true",
                            "run.progress=false", run_dir=again)
    assert all(j.quality is not None for j in record.jobs)
    for name, state in saved.items():
        back = torch.load(again / "weights" / name, weights_only=True)
        assert all(torch.equal(back[k], v) for k, v in state.items()), name

    for checkpoint in (run_dir / "checkpoints").iterdir():  # none to save them from
        checkpoint.unlink()
    assert stopped_line("interrupted (Ctrl-C)", run_dir).endswith(
        "it wrote no checkpoints to save them from; run it again for them")
    config = run_dir / "config.yaml"  # a run that saves no weights: nothing is missing
    config.write_text(config.read_text().replace("save_weights: true", "save_weights: false"))
    assert stopped_line("interrupted (Ctrl-C)", run_dir).endswith("nothing to resume")


def _stops_after_a_job_ended() -> PluginSpec:
    """A plugin that sends this process SIGTERM at the first iteration's end after a job
    ended done (another job's: the run is then stopped mid-way, one job finished)."""

    class StopAfter:
        def __init__(self, _config=None) -> None:
            self.ended: set[str] = set()
            self.fired = False

        @hookimpl
        def accelopt_release(self, job, lane, status):
            if status == "done":
                self.ended.add(job.job_id)

        @hookimpl
        def accelopt_iteration_end(self, context, result):
            if self.ended and context.job.job_id not in self.ended and not self.fired:
                self.fired = True
                os.kill(os.getpid(), signal.SIGTERM)

    return PluginSpec(name="stop_after", factory=StopAfter)


def test_a_job_finished_in_a_run_stopped_mid_way_says_why_it_has_no_score(tmp_path):
    """SIGTERM (as Ctrl-C) while the second job ran: the first, done, had quality null and an
    empty quality_note, where an unscored job says why (docs/your-model.md); the second,
    unfinished, had no note either."""
    from accelopt.cli.hydra_run import compose_checked
    from accelopt.config import register_plugin_configs, register_schema
    from accelopt.errors import Terminated, raise_terminated
    from accelopt.plugin import Registry
    from accelopt.runtime.run import execute

    spec = _stops_after_a_job_ended()
    registry = Registry.discover()
    registry.add(spec)
    register_schema()
    register_plugin_configs([spec])
    cfg = compose_checked(["+plugins=[stop_after]", "workload=tiny", "cluster.mode=none",
                           "run.compare=none", "run.progress=false",
                           "workload.jobs.0.iterations=3", "workload.jobs.1.iterations=40"])
    run_dir = tmp_path / "run"
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        with pytest.raises(Terminated):
            execute(cfg, run_dir=run_dir, registry=registry, console=Console(file=io.StringIO()))
    finally:
        signal.signal(signal.SIGTERM, previous)
    jobs = json.loads((run_dir / "metrics.json").read_text())["jobs"]
    done, stopped = jobs
    assert done["status"] == "done" and done["quality"] is None
    assert done["quality_note"] == (
        "not scored: terminated (SIGTERM) before the run scored its jobs (it does once every "
        "job has ended; a resume does)")
    assert stopped["status"] == "failed" and stopped["quality"] is None
    assert stopped["quality_note"] == "the job did not finish (the run stopped)"
