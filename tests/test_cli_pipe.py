"""A reader that leaves stdout (``accelopt run ... | head -1``) neither stops nor fails a run
or a sweep: the run ends, writes every output and log line, and exits as if still read."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from clirun import accelopt_cmd, accelopt_in_process, cli_env

pytestmark = pytest.mark.timeout(180)

TINY = ["workload=tiny", "run.progress=false"]
OUTPUTS = ("config.yaml", "metrics.json", "metrics.csv", "trace.json", "timeline.png")


class LeftAfterOneWrite(io.TextIOBase):
    """A stdout whose reader left after the first write (as ``head -1`` does): every later
    write or flush raises ``BrokenPipeError``; no file descriptor behind it."""

    encoding = "utf-8"

    def __init__(self) -> None:
        self.writes = 0

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        self.writes += 1
        if self.writes > 1:
            raise BrokenPipeError(32, "Broken pipe")
        return len(text)

    def flush(self) -> None:
        if self.writes > 1:
            raise BrokenPipeError(32, "Broken pipe")


def _log_ends_cleanly(run_dir) -> None:
    log = (run_dir / "accelopt.log").read_text(encoding="utf-8").splitlines()
    assert not [ln for ln in log if ln.startswith("error:")], log[-3:]
    assert log[-1].startswith("run directory:"), log[-3:]


def test_a_run_goes_on_after_its_reader_left(tmp_path, capfd, monkeypatch):
    stdout = LeftAfterOneWrite()
    monkeypatch.setattr(sys, "stdout", stdout)
    result = accelopt_in_process("run", *TINY, "hydra.run.dir=r", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 0, result.stderr
    assert stdout.writes > 1  # the run did print after the reader left
    assert sys.stdout is stdout  # the command's guard is gone once it returned
    assert "Error" not in result.stderr and "error" not in result.stderr, result.stderr
    for name in OUTPUTS:
        assert (tmp_path / "r" / name).is_file(), name
    _log_ends_cleanly(tmp_path / "r")


def test_a_sweep_runs_every_point_after_its_reader_left(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(sys, "stdout", LeftAfterOneWrite())
    result = accelopt_in_process("run", "-m", "+plugins=[],[noop]", *TINY,
                                 "hydra.sweep.dir=sw", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 0, result.stderr
    for point in ("0", "1"):
        assert (tmp_path / "sw" / point / "metrics.json").is_file(), point
        _log_ends_cleanly(tmp_path / "sw" / point)


def test_a_real_pipe_closed_early(tmp_path):
    """The process as a shell runs it: its file descriptor 1 a pipe whose reader closed
    before the run's first line."""
    proc = subprocess.Popen(accelopt_cmd("run", *TINY, "hydra.run.dir=r"), cwd=tmp_path,
                            env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"error" not in err, err.decode()
    for name in OUTPUTS:
        assert (tmp_path / "r" / name).is_file(), name
    _log_ends_cleanly(tmp_path / "r")


def test_piped_tables_and_the_log_have_no_trailing_spaces(tmp_path, capfd):
    """rich pads a table's centred title and a wrapped paragraph's lines with spaces to the
    console's width: in a pipe, a file or ``accelopt.log`` those lines end in spaces, which
    diffs and ``grep 'done$'`` trip over."""
    result = accelopt_in_process("run", *TINY, "hydra.run.dir=r", cwd=tmp_path, capfd=capfd)
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "r" / "accelopt.log").read_text(encoding="utf-8")
    for name, text in (("stdout", result.stdout), ("accelopt.log", log)):
        assert "Jobs\n" in text, (name, text[:200])  # the table's title, once padded
        padded = [line for line in text.splitlines() if line != line.rstrip()]
        assert not padded, (name, padded[:3])
