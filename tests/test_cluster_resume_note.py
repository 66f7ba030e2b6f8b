"""A cluster job whose rank files share no iteration (one rank's newest common file deleted)
restarts from scratch on ``run.resume``; the resume says so, where its only line was
"resuming ... from its checkpoints" and the iterations were silently redone."""

from __future__ import annotations

import pytest

from accelopt.drivers.cluster import checkpoints

pytestmark = pytest.mark.timeout(60)

JOB = "00-tiny-mlp"


def _files(run_dir, names):
    directory = checkpoints.job_dir(run_dir, JOB)
    directory.mkdir(parents=True)
    for name in names:
        (directory / name).write_bytes(b"")  # the choice is a function of the names alone
    return directory


def test_a_job_with_no_iteration_on_every_rank_is_said_to_restart(tmp_path, capsys,
                                                                 monkeypatch):
    # rank 1's file of iteration 6 (the newest both had) deleted: 4 is rank 0's alone
    directory = _files(tmp_path, ["rank0.it00000004.pt", "rank0.it00000006.pt",
                                  "rank1.it00000006.pt.gone", "rank1.it00000008.pt"])
    monkeypatch.setattr(checkpoints, "refuse_other_spec", lambda path, spec: None)
    checkpoints.refuse_unresumable(tmp_path, JOB, spec=None, world=2)
    err = capsys.readouterr().err
    assert err == (f"note: job {JOB}: no iteration every rank has a checkpoint of in "
                   f"{directory} (rank 0 has 4, 6; rank 1 has 8); it restarts from scratch "
                   "(its iterations run again)\n")


def test_a_job_with_an_iteration_on_every_rank_or_no_file_says_nothing(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(checkpoints, "refuse_other_spec", lambda path, spec: None)
    _files(tmp_path, ["rank0.it00000004.pt", "rank0.it00000006.pt", "rank1.it00000004.pt"])
    checkpoints.refuse_unresumable(tmp_path, JOB, spec=None, world=2)
    checkpoints.refuse_unresumable(tmp_path, "01-tiny-cnn", spec=None, world=2)  # no files
    assert capsys.readouterr().err == ""
