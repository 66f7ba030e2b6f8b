"""A stop (SIGTERM, Ctrl-C) that lands while a checkpoint is being written: the write ends,
the file is complete, and the stop is raised right after as the one interrupt it is. It
was raised inside ``torch.save``, whose writer then failed while handling it (``RuntimeError:
[enforce fail at inline_container.cc] unexpected pos``): a traceback, exit 1, no file."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from accelopt import errors
from accelopt.atomic import atomic_open
from accelopt.errors import Terminated, raise_terminated
from accelopt.job.checkpoint import atomic_torch_save

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                 reason="signal handlers are the main thread's")]


class SignalsMidWrite:
    """A value whose pickling (in the middle of ``torch.save``, after a tensor was written and
    before the next one) sends this process ``signum``; it loads back as 7."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __reduce__(self):
        os.kill(os.getpid(), self.signum)
        return (int, (7,))


@pytest.fixture
def handlers():
    """accelopt's SIGTERM handler and Python's own Ctrl-C one, as the ``accelopt`` command
    runs with; the previous ones back after (and no earlier SIGTERM remembered)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    errors._last_sigterm.clear()
    try:
        yield
    finally:
        errors._last_sigterm.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _state(signum: int) -> dict:
    return {"before": torch.arange(4096), "mid": SignalsMidWrite(signum),
            "after": torch.ones(4096)}


@pytest.mark.parametrize(("signum", "raised"), [(signal.SIGTERM, Terminated),
                                                (signal.SIGINT, KeyboardInterrupt)])
def test_a_stop_during_a_checkpoint_write_comes_after_the_complete_file(tmp_path, handlers,
                                                                        signum, raised):
    path = tmp_path / "checkpoints" / "00-xc.pt"
    with pytest.raises(raised) as info:
        atomic_torch_save(_state(signum), path)
    assert type(info.value) is raised  # the interrupt itself, not torch's error about it
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left
    back = torch.load(path, weights_only=False)
    assert torch.equal(back["before"], torch.arange(4096)) and back["mid"] == 7
    assert torch.equal(back["after"], torch.ones(4096))
    # the handlers are the run's again: the next stop is raised where it lands
    assert signal.getsignal(signal.SIGTERM) is raise_terminated
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_interrupt_the_writer_failed_on_is_raised_and_the_temp_file_removed(tmp_path):
    """Where an interrupt still reaches a writer (a handler that is not held), the error the
    writer raises while handling it is not what the user sees: the interrupt is, and the temp
    file is gone, the previous file untouched."""
    path = tmp_path / "00-xc.pt"
    path.write_bytes(b"previous")
    with pytest.raises(Terminated), atomic_open(path, "wb") as handle:
        handle.write(b"half")
        try:
            raise Terminated()
        except Terminated:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos "
                               "5440 vs 5392") from None
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert path.read_bytes() == b"previous"


def test_a_write_with_no_stop_leaves_the_handlers_and_raises_nothing(tmp_path, handlers):
    atomic_torch_save({"x": torch.zeros(3)}, tmp_path / "a.pt")
    assert torch.equal(torch.load(tmp_path / "a.pt")["x"], torch.zeros(3))
    assert signal.getsignal(signal.SIGTERM) is raise_terminated
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_accelopt_run_stopped_during_a_checkpoint_write_keeps_it_and_says_how_to_resume(
        tmp_path, capfd, monkeypatch):
    """The command, stopped by SIGTERM while it writes its first checkpoint: the one
    "terminated (SIGTERM)" line with the resume command, exit 143, the checkpoint there. It
    had no checkpoint and no resume command (or a traceback and exit 1)."""
    from clirun import accelopt_in_process

    real_save = torch.save
    sent: list[int] = []

    def save(obj, f, *args, **kwargs):  # the first checkpoint's pickling sends the SIGTERM
        if not sent and isinstance(obj, dict) and "job" in obj:
            sent.append(signal.SIGTERM)
            obj = {**obj, "signals_mid_write": SignalsMidWrite(signal.SIGTERM)}
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    previous = signal.getsignal(signal.SIGTERM)
    errors._last_sigterm.clear()
    run_dir = tmp_path / "run"
    try:
        result = accelopt_in_process(
            "run", "workload=single", "run.device=cpu", "run.profile=false",
            "run.progress=false", "workload.jobs.0.iterations=4", "run.checkpoint_every=2",
            f"hydra.run.dir={run_dir}", cwd=tmp_path, capfd=capfd)
    finally:
        signal.signal(signal.SIGTERM, previous)
        errors._last_sigterm.clear()
    assert sent, "no checkpoint was written"
    assert result.returncode == Terminated.exit_code, result.stderr
    assert "Traceback" not in result.stderr and "RuntimeError" not in result.stderr
    assert result.stderr.startswith("terminated (SIGTERM): ")
    assert result.stderr.rstrip().endswith(f"accelopt run run.resume={run_dir}")
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    assert checkpoint.suffix == ".pt" and not checkpoint.name.startswith(".")
    assert torch.load(checkpoint, weights_only=False)["signals_mid_write"] == 7
