"""A run whose outputs cannot be written, whose data breaks while its jobs are built, or that
is stopped, ends in one line (no traceback) that says what happened and what to do, and its
log keeps that line."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

TINY = ["workload=tiny", "run.progress=false", "run.compare=none", "cluster.mode=none"]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``accelopt run ARGS`` in this process: its exit code and its stderr."""
    import torch

    from accelopt.cli.main import main

    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as ended:
            main(["run", *args])
    finally:
        torch.set_num_threads(threads)
    return int(ended.value.code or 0), capsys.readouterr().err


def _full_disk(*_args: object, **_kwargs: object) -> None:
    """torch.save on a full disk: its RuntimeError, the OSError only chained."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as exc:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                           "69888 vs 69840") from exc


def refuse_writing(monkeypatch, name: str, code: int, reason: str) -> None:
    """The machine refuses (``code``, ``reason``) every write of a file called ``name``."""
    import accelopt.atomic as atomic

    real = atomic._create_temp

    def refused(path: Path) -> tuple[int, Path]:
        if path.name == name:
            raise OSError(code, reason, str(path))
        return real(path)

    monkeypatch.setattr(atomic, "_create_temp", refused)


def test_a_full_disk_while_saving_weights_is_one_line_naming_it_and_the_file(
        tmp_path, monkeypatch, capsys):
    import accelopt.job.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint.torch, "save", _full_disk)
    run_dir = tmp_path / "r"
    code, err = _run([*TINY, "run.checkpoint_every=0", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 1
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: cannot write {run_dir / 'weights'}")
    assert (f": No space left on device (what was written is kept in {run_dir}); free space "
            "there or make it writable, then run again") in line
    assert "inline_container" not in line


def test_a_full_disk_in_the_checkpoint_writer_is_the_same_error_in_every_caller(tmp_path):
    """The rank's checkpoint writer (``save_checkpoint``) gets the same error as one
    process's: its line names the file and the reason, not torch's enforce message."""
    import accelopt.job.checkpoint as checkpoint
    from accelopt.atomic import OutputUnwritable

    saved = checkpoint.torch.save
    checkpoint.torch.save = _full_disk
    try:
        with pytest.raises(OutputUnwritable) as raised:
            checkpoint.save_checkpoint({"job": {}}, tmp_path / "c" / "j.pt")
    finally:
        checkpoint.torch.save = saved
    assert str(raised.value).startswith(f"cannot write {tmp_path / 'c' / 'j.pt'}: No space")
    assert raised.value.errno == errno.ENOSPC and isinstance(raised.value, OSError)
    assert not list((tmp_path / "c").iterdir())  # no temp file left behind


def test_an_output_directory_made_unwritable_is_one_line_with_the_summary_printed(
        tmp_path, monkeypatch, capsys):
    """EPERM (``chattr +i``) when the run's outputs are written: one line naming the file,
    the OS's reason and what to do, after the console summary of the jobs that ran."""
    refuse_writing(monkeypatch, "metrics.json", errno.EPERM, "Operation not permitted")
    run_dir = tmp_path / "r"
    code, err = _run([*TINY, f"hydra.run.dir={run_dir}"], capsys)
    assert code == 1
    assert "Traceback" not in err
    assert (f"error: cannot write {run_dir / 'metrics.json'}: Operation not permitted (what "
            f"was written is kept in {run_dir}); free space there or make it writable, then "
            "run again") in err
    log = (run_dir / "accelopt.log").read_text()
    assert "run directory:" in log  # the summary was printed before the line
    assert log.rstrip().splitlines()[-1].startswith("error: cannot write ")


def test_a_sigterm_leaves_its_closing_line_in_the_log(tmp_path, monkeypatch, capsys):
    """The console said where the outputs are kept and how to resume; the log ended with
    "error: terminated (SIGTERM)" only."""
    import accelopt.job.checkpoint as checkpoint
    from accelopt.errors import Terminated

    real = checkpoint.Checkpointer.after_iteration
    calls = []

    def stop_after_a_checkpoint(self, job, result):  # type: ignore[no-untyped-def]
        real(self, job, result)
        calls.append(1)
        if self.written:
            raise Terminated()

    monkeypatch.setattr(checkpoint.Checkpointer, "after_iteration", stop_after_a_checkpoint)
    run_dir = tmp_path / "t"
    code, err = _run([*TINY, "run.checkpoint_every=2", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 143
    closing = err.strip().splitlines()[-1]
    assert closing.startswith("terminated (SIGTERM): ") and "run.resume=" in closing
    log = (run_dir / "accelopt.log").read_text().rstrip().splitlines()
    assert log[-1] in (closing, f"error: {closing}")
    assert json.loads((run_dir / "metrics.json").read_text())["jobs"]


def test_a_stopped_run_keeps_its_plugins_rows(tmp_path, monkeypatch, capsys):
    """SIGTERM after 2 iterations: metrics.json listed no plugin ("plugins": []), though the
    plugin had acted on every iteration that ran."""
    import accelopt.job.checkpoint as checkpoint
    from accelopt.drivers.rows import SILENT_SUMMARY
    from accelopt.errors import Terminated

    real = checkpoint.Checkpointer.after_iteration

    def stop_at_iteration_2(self, job, result):  # type: ignore[no-untyped-def]
        real(self, job, result)
        if job.iteration >= 2:
            raise Terminated()

    monkeypatch.setattr(checkpoint.Checkpointer, "after_iteration", stop_at_iteration_2)
    run_dir = tmp_path / "t"
    code, _ = _run([*TINY, "+plugins=[noop]", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 143
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["summary"]["error"] == "terminated (SIGTERM)"
    assert [row["plugin"] for row in metrics["plugins"]] == ["noop"]
    assert metrics["plugins"][0]["summary"] != SILENT_SUMMARY, metrics["plugins"]  # its own


class BrokenRecords:
    """A map-style dataset whose records past 100 cannot be read (a corrupt shard)."""

    num_classes = 4

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[object, int]:
        import torch

        if i >= 100:
            raise OSError(f"corrupt record {i}")
        return torch.full((16,), float(i % 7)), i % 4


def broken_records() -> BrokenRecords:
    return BrokenRecords()


def test_data_that_raises_while_the_job_is_built_is_refused_in_one_line(tmp_path, capsys):
    """One process: a dataset raising while its first batch was read (before any job
    started) was Hydra's traceback; now one line naming the job, the dataset and the error,
    as a dataset factory that raises is refused."""
    run_dir = tmp_path / "b"
    code, err = _run([*TINY, "workload.jobs.0.dataset=test_failed_run_outputs:broken_records",
                      "workload.jobs.0.batch_size=64", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 2
    assert "Traceback" not in err and "Error executing job" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: job 'tiny-mlp': dataset 'test_failed_run_outputs:"
                           "broken_records' raised OSError: corrupt record ")
    assert "while the job was built" in line and "fix the data it reads" in line


def test_a_full_disk_after_checkpoints_were_written_says_how_to_resume(
        tmp_path, monkeypatch, capsys):
    """The weights cannot be written but the job's checkpoints were: the line says the
    reason, the file and the resume command (after freeing space)."""
    import accelopt.job.checkpoint as checkpoint

    real = checkpoint.torch.save

    def weights_refused(obj: object, handle: object, *args: object, **kwargs: object) -> None:
        if isinstance(obj, dict) and "job" not in obj:  # a model's weights, no checkpoint
            _full_disk()
        real(obj, handle, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", weights_refused)
    run_dir = tmp_path / "r"
    code, err = _run([*TINY, "run.checkpoint_every=2", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 1 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: cannot write {run_dir / 'weights'}")
    assert ": No space left on device (what was written is kept in " in line
    assert line.endswith(f"; continue it from its checkpoints with: accelopt run "
                         f"run.resume={run_dir}")


def test_an_unwritable_output_after_every_job_ended_offers_no_resume(
        tmp_path, monkeypatch, capsys):
    """Every job done (metrics.json says so), a later file refused: nothing to resume."""
    refuse_writing(monkeypatch, "timeline.png", errno.ENOSPC, "No space left on device")
    run_dir = tmp_path / "r"
    code, err = _run([*TINY, "run.checkpoint_every=2", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 1 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: cannot write {run_dir / 'timeline.png'}: No space left")
    assert "run.resume" not in line


def test_a_dead_rank_with_checkpoints_is_said_resumable(tmp_path):
    """A SIGKILLed rank's run wrote checkpoints: its line gives the resume command; a rank's
    refusal of bad input, or a run whose jobs are all done, gets none."""
    from accelopt.cli.hydra_run import resumable_after
    from accelopt.errors import RankFailed

    killed = RankFailed("rank 1 (worker, pid 9) was killed by SIGKILL", rank=1, pid=9,
                        iteration=3, cause="SIGKILL")
    refused = RankFailed("bad input", rank=1, pid=9, iteration=None, cause="x", exit_code=2)
    assert not resumable_after(killed, tmp_path)  # no checkpoints yet
    (tmp_path / "checkpoints" / "00-j").mkdir(parents=True)
    (tmp_path / "checkpoints" / "00-j" / "rank1.it00000002.pt").write_bytes(b"")
    assert resumable_after(killed, tmp_path) and not resumable_after(refused, tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({"jobs": [{"status": "done"}]}))
    assert not resumable_after(killed, tmp_path)
