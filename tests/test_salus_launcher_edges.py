"""``hydra/launcher=salus`` at its edges: a sweeper that launches in batches (each batch its
own shared execution, none written over), a Ctrl-C in a packed sweep (one line saying where
what ran is kept and how to go on, as under the basic launcher), ``run.compare`` (refused,
not dropped unsaid) and launcher settings named as the command line spelled them."""

from __future__ import annotations

import json

import pytest
from clirun import sweep_in_process

pytestmark = pytest.mark.timeout(180)
SWEEP = ["workload=tiny", "workload.jobs.0.lr=0.01,0.05", "run.threads=1",
         "run.progress=false", "hydra/launcher=salus", "hydra.launcher.threads=1"]


def sweep(tmp_path, name, *extra):
    """``accelopt run -m SWEEP EXTRA`` in this process; its exit code and sweep directory."""
    return sweep_in_process(SWEEP, tmp_path / name, *extra), tmp_path / name


def test_each_batch_packs_into_its_own_shared_execution(tmp_path, capsys):
    """Every batch wrote ``salus-pack``: the last one's record was all that was left, while
    the earlier runs' metrics still named it as their packed execution."""
    code, out = sweep(tmp_path, "mb", "hydra.sweeper.max_batch_size=1")
    assert code == 0
    packs = {"0": out / "salus-pack", "1": out / "salus-pack-1"}
    for run, pack in packs.items():
        shared = json.loads((pack / "metrics.json").read_text())
        assert [j["name"] for j in shared["jobs"]] == [f"r{run}-tiny-mlp", f"r{run}-tiny-cnn"]
        assert (pack / "trace.json").is_file()
        ours = json.loads((out / run / "metrics.json").read_text())
        assert ours["summary"]["packed_execution"] == str(pack)
        assert ours["summary"]["packed_runs"] == 1
    said = " ".join(capsys.readouterr().out.split())
    assert "run #1 (2 jobs) packed onto one device" in said
    assert "packed per batch of up to 1, each batch in its own shared execution" in said


def _interrupted_after(real_execute):
    """``execute`` that runs the shared execution and is then stopped as by a Ctrl-C while
    its jobs were still training (its metrics say so): no sleep, no signal timing."""

    def execute(cfg, run_dir, **kwargs):
        real_execute(cfg, run_dir=run_dir, **kwargs)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        for job in metrics["jobs"]:
            job["status"] = "running"
        (run_dir / "metrics.json").write_text(json.dumps(metrics))
        raise KeyboardInterrupt

    return execute


def test_a_ctrl_c_in_the_packed_execution_says_where_and_how_to_resume(tmp_path, capsys,
                                                                         monkeypatch):
    import accelopt.runtime.run as run_module

    monkeypatch.setattr(run_module, "execute", _interrupted_after(run_module.execute))
    code, out = sweep(tmp_path, "int", "run.checkpoint_every=2")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert len(err) == 1, err
    shared = out / "salus-pack"
    assert err[0].startswith(f"interrupted (Ctrl-C): what ran is kept in {shared}"), err
    assert f"accelopt run run.resume={shared}" in err[0]
    assert "the sweep stopped in the packed execution of runs #0-#1" in err[0]


def test_a_ctrl_c_while_the_record_is_split_says_which_runs_were_written(tmp_path, capsys,
                                                                         monkeypatch):
    from accelopt_plugins.salus import sweep as launcher

    real_write_run, calls = launcher.write_run, []

    def write_run(run, *args):
        calls.append(run.index)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_write_run(run, *args)

    monkeypatch.setattr(launcher, "write_run", write_run)
    code, out = sweep(tmp_path, "split")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert err == [f"interrupted (Ctrl-C) after the packed execution of runs #0-#1 ended, "
                   f"while it was split into their run directories: the whole record is in "
                   f"{out / 'salus-pack'}; #0 written, not #1; for their own run "
                   "directories, sweep run #1 again with a new hydra.sweep.dir (a directory "
                   "holding a sweep's runs is not written into again)"]
    assert (out / "0" / "metrics.json").is_file()


@pytest.mark.parametrize("extra,words", [
    (["run.compare=each"], "hydra/launcher=salus runs no run.compare reference runs, but "
                           "run.compare=each; drop run.compare"),
    (["hydra.launcher.max_lanes=-5"], "hydra.launcher.max_lanes must be -1"),
    (["hydra.launcher.threads=-1"], "hydra.launcher.threads must be in [0, "),
], ids=["compare", "max-lanes", "threads"])
def test_refused_in_one_line_naming_the_key_given(tmp_path, capsys, extra, words):
    code, out = sweep(tmp_path, "refused", *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: hydra"), err
    assert words in err[0]
    assert "plugins.salus." not in err[0]
    assert not out.exists()


def test_a_ctrl_c_in_a_later_batch_says_which_runs_ended_before_it(tmp_path, capsys,
                                                                    monkeypatch):
    import accelopt.runtime.run as run_module

    real_execute, calls = run_module.execute, []

    def execute(cfg, run_dir, **kwargs):
        calls.append(run_dir)
        if len(calls) == 2:  # the second batch, stopped before it wrote anything
            raise KeyboardInterrupt
        return real_execute(cfg, run_dir=run_dir, **kwargs)

    monkeypatch.setattr(run_module, "execute", execute)
    code, out = sweep(tmp_path, "later", "hydra.sweeper.max_batch_size=1")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert err == [f"interrupted (Ctrl-C) before {out / 'salus-pack-1'} held anything; the "
                   "sweep stopped in the packed execution of run #1: it is not split into "
                   "their run directories (a resume trains their jobs on into one new "
                   "directory, job r<k>-<name> being run k's); run #0 ended before it (kept "
                   f"in {out}), and any later batch did not run; for their own run "
                   "directories, sweep run #1 and any later batch again with a new "
                   "hydra.sweep.dir (a directory holding a sweep's runs is not written into "
                   "again)"]
    assert (out / "0" / "metrics.json").is_file()


@pytest.mark.parametrize("name, noted", [("salus-pack", True), ("salus-pack-3", True),
                                         ("salus-packed", False), ("run-0", False)])
def test_a_later_batchs_shared_execution_resumes_with_the_packed_sweep_note(tmp_path, name,
                                                                            noted):
    """A batched sweep's later batches pack into ``salus-pack-<k>``: resuming one is the same
    as resuming ``salus-pack`` (its jobs go into one directory), and says so."""
    from accelopt.runtime.resume_target import packed_sweep_note

    note = packed_sweep_note(tmp_path / name, tmp_path / "out")
    assert bool(note) is noted and (not noted or "sweep's shared execution" in note)
