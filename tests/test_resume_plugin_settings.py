"""A resume runs with the plugins and plugin settings its checkpoints were written with.

Each checkpoint records the run's plugin set and settings beside its job spec; a resume whose
``config.yaml`` was edited in them was refused only by a plugin's state load, after the new
run directory was made (a removed plugin), or not at all (an edited setting ran the rest of
the job with the new value on state made with the old one)."""

from __future__ import annotations

import pytest
import torch
from clirun import run_files, run_in_process

from accelopt.errors import UserError
from accelopt.job.checkpoint import PLUGIN_SETTINGS

JOB = ("workload=single", "workload.jobs.0.iterations=4", "workload.jobs.0.width=16",
       "run.progress=false", "run.checkpoint_every=2", "+plugins=[noop]")


def _first(tmp_path):
    first = tmp_path / "first"
    run_in_process(*JOB, run_dir=first)
    return first


def _edit(run_dir, old: str, new: str) -> None:
    config = (run_dir / "config.yaml").read_text()
    assert old in config
    (run_dir / "config.yaml").write_text(config.replace(old, new))


def _checkpoints(run_dir):
    return sorted((run_dir / "checkpoints").rglob("*.pt"))


@pytest.mark.timeout(120)
def test_an_edited_plugin_setting_is_refused_before_anything_is_written(tmp_path):
    """In this process (the command line prints the same line, exit 2: ``UserError``)."""
    first = _first(tmp_path)
    _edit(first, "record: true", "record: false")
    before = run_files(first)
    again = tmp_path / "again"
    with pytest.raises(UserError) as refused:
        run_in_process(f"run.resume={first}", "run.resume_finished=true", run_dir=again)
    line = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in line
    assert "plugins.noop.record was true and is false now" in line, line
    assert "resume with the original settings" in line and "start a new run" in line, line
    assert not again.exists()
    assert run_files(first) == before


@pytest.mark.timeout(120)
def test_a_removed_plugin_is_refused_before_anything_is_written(tmp_path):
    first = _first(tmp_path)
    config = (first / "config.yaml").read_text()
    head, plugins = config.split("plugins:\n")
    (first / "config.yaml").write_text(head + "plugins: {}\n")
    again = tmp_path / "again"
    with pytest.raises(UserError) as refused:
        run_in_process(f"run.resume={first}", "run.resume_finished=true", run_dir=again)
    assert "plugin 'noop' was active and is no longer selected" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not again.exists()
    assert "record: true" in plugins


@pytest.mark.timeout(120)
def test_an_unchanged_resume_runs_and_its_checkpoints_record_the_settings(tmp_path):
    first = _first(tmp_path)
    recorded = [torch.load(p, weights_only=False)[PLUGIN_SETTINGS] for p in _checkpoints(first)]
    assert recorded and all(r == {"noop": {"record": True}} for r in recorded), recorded
    again = tmp_path / "again"
    run_in_process(f"run.resume={first}", "run.resume_finished=true", "run.progress=false",
                   run_dir=again)
    assert (again / "metrics.json").is_file()
    run_in_process(f"run.resume={again}", "run.resume_finished=true", "run.progress=false",
                   run_dir=tmp_path / "chain")  # a resume of the resume: the same settings
    # the resumed run's own checkpoints record them too (a resume of the resume is checked)
    _edit(again, "record: true", "record: false")
    with pytest.raises(UserError, match="plugins.noop.record was true and is false now"):
        run_in_process(f"run.resume={again}", "run.resume_finished=true",
                       run_dir=tmp_path / "third")


@pytest.mark.timeout(120)
def test_a_checkpoint_without_the_record_still_resumes(tmp_path):
    """Checkpoints written before the settings were recorded resume unchecked."""
    first = _first(tmp_path)
    for path in _checkpoints(first):
        state = torch.load(path, weights_only=False)
        del state[PLUGIN_SETTINGS]
        torch.save(state, path)
    _edit(first, "record: true", "record: false")
    again = tmp_path / "again"
    run_in_process(f"run.resume={first}", "run.resume_finished=true", "run.progress=false",
                   run_dir=again)
    assert (again / "metrics.json").is_file()


@pytest.mark.timeout(180)
def test_a_cluster_runs_rank_checkpoints_record_the_settings_and_an_edit_is_refused(tmp_path):
    """Each rank writes its own files (``RankCheckpointer``): they carry the record too."""
    first = tmp_path / "first"
    run_in_process(*JOB, "cluster.mode=ps", "cluster.workers=1", run_dir=first)
    recorded = [torch.load(p, weights_only=False)[PLUGIN_SETTINGS] for p in _checkpoints(first)]
    assert recorded and all(r == {"noop": {"record": True}} for r in recorded), recorded
    _edit(first, "record: true", "record: false")
    again = tmp_path / "again"
    with pytest.raises(UserError, match="plugins.noop.record was true and is false now"):
        run_in_process(f"run.resume={first}", "run.resume_finished=true", run_dir=again)
    assert not again.exists()
