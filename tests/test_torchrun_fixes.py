"""A torchrun job's ranks share one run directory: what each rank checks there must not be
upset by what a peer rank of the same job wrote there first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from accelopt.errors import ConfigError
from accelopt.runtime.resume_target import carry_checkpoints
from accelopt.runtime.run_dir import claim, refuse_taken

pytestmark = pytest.mark.timeout(240)


def _stopped_run(root: Path) -> Path:
    """A cluster run's directory holding the checkpoint parts of two ranks."""
    old = root / "a"
    parts = old / "checkpoints" / "00-tiny-mlp"
    parts.mkdir(parents=True)
    for rank in (0, 1):
        (parts / f"rank{rank}.it00000100.pt").write_bytes(bytes([rank]) * 64)
    return old


def test_a_peer_ranks_carried_checkpoints_do_not_refuse_the_resume(tmp_path):
    old = _stopped_run(tmp_path)
    new = tmp_path / "c"
    carry_checkpoints(old / "checkpoints", new / "checkpoints")  # the peer rank, first
    claim(new, shared=True, resuming=old)  # this rank: its own resume's files, not a run's


def test_carried_checkpoints_are_told_apart_from_the_saved_config(tmp_path):
    # the command line claims before it knows of the resume: the config a peer saved says it
    old = _stopped_run(tmp_path)
    new = tmp_path / "c"
    new.mkdir()
    (new / "config.yaml").write_text(f"run:\n  resume: {old}\n")
    carry_checkpoints(old / "checkpoints", new / "checkpoints")
    refuse_taken(new, shared=True)


def test_an_unfinished_runs_own_checkpoints_still_refuse_in_the_torchrun_form(tmp_path):
    old = _stopped_run(tmp_path)
    new = tmp_path / "c"
    carry_checkpoints(old / "checkpoints", new / "checkpoints")
    (new / "checkpoints" / "00-tiny-mlp" / "rank0.it00000200.pt").write_bytes(b"own")
    with pytest.raises(ConfigError, match="the same torchrun command given run.resume="):
        refuse_taken(new, shared=True, resuming=old)
    with pytest.raises(ConfigError, match=r"continue it with run\.resume="):
        refuse_taken(new, shared=False, resuming=old)  # one process: no peer carries


def test_an_exclusive_write_never_replaces_a_file_written_meanwhile(tmp_path):
    from accelopt.atomic import atomic_open

    target = tmp_path / "report.json"
    with pytest.raises(FileExistsError):
        with atomic_open(target, exclusive=True) as mine:
            mine.write("mine\n")
            with atomic_open(target, exclusive=True) as theirs:  # the other rank, first
                theirs.write("theirs\n")
    assert target.read_text() == "theirs\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temp file left


def test_two_ranks_closing_an_attach_on_one_run_dir_refuse_the_second(tmp_path, monkeypatch):
    """The other rank's report lands between this rank's look and its write."""
    import contextlib

    import torch

    import accelopt
    import accelopt.your_loop as your_loop

    ao = accelopt.attach(torch.nn.Linear(4, 2), [], run_dir=tmp_path / "r", name="rank1")
    real = your_loop.atomic_open

    @contextlib.contextmanager
    def after_the_other_rank(path, *args, **kwargs):
        Path(path).write_text('{"job": {"name": "rank0"}}\n')
        with real(path, *args, **kwargs) as handle:
            yield handle

    monkeypatch.setattr(your_loop, "atomic_open", after_the_other_rank)
    with pytest.raises(ConfigError, match="give each process, each torchrun rank, its own "
                                          "run_dir"):
        ao.close()
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["job"]["name"] == "rank0"


def test_a_ctrl_c_under_torchrun_stays_a_ctrl_c_through_torchruns_sigterm(monkeypatch):
    """torchrun follows a Ctrl-C with SIGTERM: it must not turn the rank's "interrupted
    (Ctrl-C)" (its metrics.json) into "terminated (SIGTERM)" (its line) halfway."""
    import signal
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from accelopt.drivers.cluster import launch

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "torchrun_rank", lambda: (0, 2))
    monkeypatch.setattr(launch, "_torchrun_checks",
                        lambda *a: (SimpleNamespace(role=lambda r: "worker"), None))
    monkeypatch.setattr(launch, "run_rank", ctrl_c)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            launch._run_torchrun(OmegaConf.create({}), "unused", None)
        assert type(raised.value) is KeyboardInterrupt  # not a peer's failure
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_stopped_torchrun_run_says_its_losses_are_not_kept(tmp_path):
    """Under torchrun the ranks' so-far results are not collected: metrics.json counted the
    iterations with no losses, and nothing said the losses were missing."""
    from accelopt.cli.hydra_run import stopped_line
    from accelopt.runtime.run import _stopped_note

    note = _stopped_note([], 2, torchrun=True)
    assert "losses and timelines of the iterations its ranks ran are not kept" in note
    assert _stopped_note([], 2) != note  # the launcher's own ranks: their timelines only
    (tmp_path / "metrics.json").write_text(json.dumps({"telemetry": {"note": note}}))
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    assert stopped_line("interrupted (Ctrl-C)", tmp_path).endswith(note)
