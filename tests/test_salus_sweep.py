"""``hydra/launcher=salus``: a sweep's runs packed onto one device in one salus execution.
Each run keeps its own directory with the outputs of the basic launcher, its jobs under
their own ids, and (deterministic settings) bitwise the basic launcher's weights; a sweep
that cannot be packed is refused in one line before anything runs or is written."""

from __future__ import annotations

import json

import pytest
import torch
from clirun import sweep_in_process
from omegaconf import OmegaConf

pytestmark = pytest.mark.timeout(180)
SWEEP = ["workload=tiny", "workload.jobs.0.lr=0.01,0.05", "run.threads=1",
         "run.progress=false"]


def sweep(tmp_path, name, *extra):
    """``accelopt run -m SWEEP EXTRA`` in this process; its exit code."""
    return sweep_in_process(SWEEP, tmp_path / name, *extra), tmp_path / name


def test_packed_runs_have_their_own_outputs_and_the_basic_launchers_weights(tmp_path):
    code, basic = sweep(tmp_path, "basic")
    assert code == 0
    code, packed = sweep(tmp_path, "packed", "hydra/launcher=salus", "hydra.launcher.threads=1")
    assert code == 0
    assert (packed / "salus-pack" / "metrics.json").is_file()  # the shared execution
    shared = json.loads((packed / "salus-pack" / "metrics.json").read_text())
    shared_events = json.loads((packed / "salus-pack" / "trace.json").read_text())["traceEvents"]
    assert [e for e in shared_events if e.get("cat") == "hook"]  # salus's calls: kept there
    assert len(shared["jobs"]) == 4  # both runs' jobs in one execution
    for run in ("0", "1"):
        names = {p.name for p in (basic / run).iterdir()}
        assert {"config.yaml", "metrics.json", "metrics.csv", "trace.json", "timeline.png",
                "weights", "accelopt.log"} <= names
        assert names - {".hydra"} <= {p.name for p in (packed / run).iterdir()}
        hydra_files = {p.name for p in (basic / run / ".hydra").iterdir()}
        assert hydra_files == {p.name for p in (packed / run / ".hydra").iterdir()}
        ours = json.loads((packed / run / "metrics.json").read_text())
        theirs = json.loads((basic / run / "metrics.json").read_text())
        assert [j["job_id"] for j in ours["jobs"]] == [j["job_id"] for j in theirs["jobs"]]
        assert [j["final_loss"] for j in ours["jobs"]] == [j["final_loss"] for j in theirs["jobs"]]
        assert ours["summary"]["packed_runs"] == 2
        # a run's trace holds its own jobs, not the shared execution's hook calls
        events = json.loads((packed / run / "trace.json").read_text())["traceEvents"]
        assert not [e for e in events if e.get("cat") == "hook"]
        assert {e.get("cat") for e in events} >= {"iteration"}
        for weights in sorted((basic / run / "weights").glob("*.pt")):
            a = torch.load(weights, weights_only=True)
            b = torch.load(packed / run / "weights" / weights.name, weights_only=True)
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a), (run, weights.name)
    lrs = [OmegaConf.load(packed / r / "config.yaml").workload.jobs[0].lr for r in "01"]
    assert lrs == [0.01, 0.05]  # each run's own config, not the merged one
    from accelopt.runtime.compare import in_multirun

    assert not in_multirun()  # a later accelopt.run in this process is not "in a sweep"


def test_a_packed_runs_checkpoints_resume_that_run(tmp_path):
    """Each run's checkpoints held the merged job's spec (``r0-tiny-mlp``), so resuming a
    run of a packed sweep was always refused as written for a different job spec."""
    import accelopt

    code, packed = sweep(tmp_path, "packed", "hydra/launcher=salus", "run.checkpoint_every=2")
    assert code == 0
    for run in ("0", "1"):
        state = torch.load(packed / run / "checkpoints" / "00-tiny-mlp.pt", weights_only=False)
        assert state["spec"]["name"] == "tiny-mlp"
    threads = torch.get_num_threads()
    try:
        record = accelopt.run([f"run.resume={packed / '1'}", "run.resume_finished=true",
                               "run.progress=false"], run_dir=tmp_path / "resumed")
    finally:
        torch.set_num_threads(threads)
    assert [j.status for j in record.jobs] == ["done", "done"]
    assert record.jobs[0].job.name == "tiny-mlp"


@pytest.mark.parametrize("extra,words", [
    (["run.seed=1,2"], "differ in 'run'"),
    (["cluster.mode=ps"], "cluster.mode=ps"),
    # the runs' own salus settings are used: a launcher policy beside them would be dropped
    (["+plugins=[salus]", "hydra.launcher.policy=fair"],
     "hydra.launcher.policy=fair and the runs' own +plugins=[salus] (plugins.salus.policy=auto)"
     " disagree"),
    # found by the runs' salus, named as a key the command line did not have
    (["hydra.launcher.policy=bogus"], "hydra.launcher.policy: unknown policy 'bogus'"),
], ids=["not-only-the-workload", "cluster-mode", "two-policies", "unknown-policy"])
def test_a_sweep_that_cannot_be_packed_is_one_line_and_leaves_nothing(tmp_path, capsys,
                                                                      extra, words):
    code, out = sweep(tmp_path, "refused", "hydra/launcher=salus", *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: hydra"), err
    assert words in err[0]
    assert not out.exists()


def test_the_launcher_is_found_after_hydra_scanned_its_plugins_elsewhere(tmp_path):
    """Hydra scans ``hydra_plugins`` once per process; under an editable install, from a
    directory other than the checkout, that scan cannot list the launcher. A process that
    made Hydra's plugin registry first (any earlier Hydra use) must still get
    ``hydra/launcher=salus``, not "no hydra 'launcher/salus'"."""
    import subprocess
    import sys

    script = ("from hydra.core.plugins import Plugins; Plugins.instance()\n"
              "from accelopt.cli.main import main\n"
              f"main(['run', '-m', *{SWEEP!r}, 'run.seed=1,2', 'hydra/launcher=salus', "
              f"'hydra.sweep.dir={tmp_path / 'refused'}'])\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert err and err[-1].startswith("error: hydra/launcher=salus"), err


class _CountingLoader:
    """Stands in for Hydra's config loader: counts compositions."""

    def __init__(self) -> None:
        self.composed: list[list[str]] = []

    def load_sweep_config(self, master_config, sweep_overrides):
        self.composed.append(list(sweep_overrides))
        return OmegaConf.create({"run": len(self.composed)})


def test_the_launcher_takes_the_configs_the_sweeper_composed_to_validate():
    from accelopt_plugins.salus.sweep import ValidatedConfigs

    loader, master = _CountingLoader(), OmegaConf.create({})
    validated = ValidatedConfigs(loader)
    for overrides in (["lr=1"], ["lr=2"]):  # what the basic sweeper does for a batch
        loader.load_sweep_config(master_config=master, sweep_overrides=overrides)
    assert validated.take(master, ["lr=2"]).run == 2 and validated.take(master, ["lr=1"]).run == 1
    assert len(loader.composed) == 2  # not composed again
    assert validated.take(master, ["lr=1"]).run == 3  # taken once: a second ask composes
    assert validated.take(OmegaConf.create({}), ["lr=2"]).run == 4  # another master config
    assert loader.composed[2:] == [["lr=1"], ["lr=2"]]


def test_a_sweep_whose_jobs_fail_exits_non_zero_with_either_launcher(tmp_path, capsys):
    """Packed, a sweep whose jobs failed exited 0: a CI sweep read as passing. Both
    launchers now end it alike: each run's line, which runs failed, exit code 3."""
    failing = ["workload.jobs.0.model=byo_models:raises_after",
               "workload.jobs.0.dataset=synthetic_vectors"]
    for name, extra in (("basic", []), ("packed", ["hydra/launcher=salus",
                                                   "hydra.launcher.threads=1"])):
        code, _out = sweep(tmp_path, name, *failing, *extra)
        err = capsys.readouterr().err
        assert code == 3, (name, err)
        closing = err.strip().splitlines()[-1]
        assert closing.startswith("error: 2 of 2 runs of the sweep failed: #0, #1 (#0: 1 of 2 "
                                  "jobs did not complete; 'tiny-mlp' failed: a step measuring "
                                  "its memory, before training, raised RuntimeError: boom"), \
            (name, closing)
        summary = json.loads((_out / "sweep.json").read_text())  # alike in sweep.json too
        assert (summary["complete"], summary["exit_code"], summary["failed"]) == (True, 3, [0, 1])
        assert [(p["point"], p["run_dir"], p["status"]) for p in summary["points"]] == [
            (0, "0", "failed"), (1, "1", "failed")], name
        assert "raised RuntimeError: boom" in summary["points"][0]["error"], name
        assert summary["launcher"] == ("salus" if name == "packed" else "basic")
