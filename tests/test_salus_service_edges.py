"""`accelopt serve` at its edges: a diverged job in `status` and its strict-JSON `job.json`,
what a factory may return, a cancel that lands inside an iteration, and the answer a `wait`
gets when the service stops under it. In-process (a :class:`Service`, its executor run to
its end), synchronised by events, never by sleeps."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from accelopt_plugins.salus import cli
from accelopt_plugins.salus.service import ServeOptions, Service

from accelopt import UserError
from accelopt.config import JobConfig

pytestmark = pytest.mark.timeout(120)
TINY = {"model": "mlp", "iterations": 5, "width": 16, "batch_size": 8, "seed": 3}
HERE = Path(__file__).stem


def _service(tmp_path: Path) -> Service:
    return Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root",
                                capacity="256MiB", threads=1))


def _run_to_end(service: Service) -> None:
    """Run the jobs submitted so far to their end and write their files."""
    service.executor.close()
    service.executor.run()
    service.finish_outputs()


def _strict(path: Path) -> dict:
    """``path`` read as strict JSON: a ``NaN`` (Python's json writes it) is refused."""
    def refuse(name: str) -> None:
        raise ValueError(f"{name} in {path.name}")

    return json.loads(path.read_text(), parse_constant=refuse)


# -- user code the service imports -----------------------------------------------------------


def trains_returns_metrics(iterations: int = 2) -> dict:
    """A training function: trains, returns its metrics."""
    return {"loss": 1.0, "accuracy": 0.5}


def trains_returns_settings(iterations: int = 2, lr: float = 0.1) -> dict:
    """A training function returning the settings it trained with (all JobConfig keys)."""
    return {"lr": lr, "iterations": iterations}


def config_job(iterations: object = 3) -> JobConfig:
    """A factory returning a JobConfig; its ``iterations`` as given (a string from a CLI)."""
    return JobConfig(name="cfg", model="mlp", iterations=iterations,  # type: ignore[arg-type]
                     width=16, batch_size=8)


ENTERED, RELEASE = threading.Event(), threading.Event()
GATE = {"armed": False}


class _Gated(torch.nn.Module):
    """An MLP whose forward, once armed, waits inside the iteration until released."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        size = 1
        for dim in input_shape:
            size *= int(dim)
        self.fc = torch.nn.Linear(size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if GATE["armed"]:
            ENTERED.set()
            RELEASE.wait(60)
        return self.fc(x.flatten(1))


def gated_net(input_shape: tuple[int, ...], num_classes: int = 10) -> torch.nn.Module:
    return _Gated(input_shape, num_classes)


# -- findings --------------------------------------------------------------------------------


def test_a_diverged_job_is_said_in_status(tmp_path, capsys, monkeypatch):
    """A job done on a loss of nan showed as a plain ``done`` row, quality "–" and no error,
    and ``status --json`` had no ``diverged``."""
    service = _service(tmp_path)
    (job_id,) = service.handle({"op": "submit", "job": {**TINY, "lr": 1e30, "name": "div"}})[
        "submitted"]
    _run_to_end(service)
    reply = {"ok": True, **service.status()}
    (row,) = reply["jobs"]
    assert row["state"] == "done" and row["diverged"] is True
    assert row["quality_note"].startswith("not scored: the loss diverged")

    monkeypatch.setattr(cli, "_ask", lambda opts, message: reply)
    assert cli.status_cmd([]) == 0
    table = capsys.readouterr().out
    line = next(text for text in table.splitlines() if job_id in text)
    assert "diverged" in line and " done " not in line
    assert "not scored: the loss diverged" in " ".join(table.split())


def test_a_diverged_job_s_job_json_is_strict_json(tmp_path):
    """Its job.json held ``"losses": [2.27, NaN, ...]``: not JSON to a strict reader."""
    service = _service(tmp_path)
    (job_id,) = service.handle({"op": "submit", "job": {**TINY, "lr": 1e30, "name": "div"}})[
        "submitted"]
    _run_to_end(service)
    doc = _strict(tmp_path / "root" / "jobs" / job_id / "job.json")
    assert doc["job"]["diverged"] is True and None in doc["losses"]
    assert doc["job"]["status"] == "done"


@pytest.mark.parametrize("fn, shown", [("trains_returns_metrics", "'loss', 'accuracy'"),
                                       ("trains_returns_settings", "'lr', 'iterations'")])
def test_a_factory_dict_that_names_no_model_is_refused_as_no_job(tmp_path, fn, shown):
    """A training function's metrics were read as job keys ("unknown key 'accuracy'"), and
    one returning only valid keys was taken as a default mlp job."""
    service = _service(tmp_path)
    try:
        with pytest.raises(UserError) as info:
            service.handle({"op": "submit", "factory": f"{HERE}:{fn}", "args": {}})
        line = str(info.value)
        assert "\n" not in line
        assert line.startswith(f'{HERE}:{fn} returned a dict without "model" ({shown}), not '
                               "a job: the service (pid")
        assert "ran to its end there" in line
        assert service.executor.snapshot() == []
    finally:
        service.executor.close()
        service.finish_outputs()


@pytest.mark.parametrize("args", [{"iterations": "abc"}, {"iterations": [1, 2]}])
def test_a_factory_job_of_the_wrong_type_is_one_line(tmp_path, args):
    """A JobConfig with ``iterations="abc"`` reached the job's checks: the client got
    "TypeError: '<' not supported ..." and the service's log a traceback."""
    service = _service(tmp_path)
    try:
        with pytest.raises(UserError) as info:
            service.handle({"op": "submit", "factory": f"{HERE}:config_job", "args": args})
        line = str(info.value)
        assert line.startswith(f"{HERE}:config_job returned a bad job: iterations: ")
        assert "\n" not in line
        assert service.executor.snapshot() == []
        # a JobConfig of the right types is taken as before
        (job_id,) = service.handle({"op": "submit", "factory": f"{HERE}:config_job",
                                    "args": {"iterations": 2}})["submitted"]
        assert job_id == "001-cfg"
        _run_to_end(service)
        assert _strict(tmp_path / "root" / "jobs" / job_id / "job.json")["job"]["status"] \
            == "done"
    finally:
        service.executor.close()
        service.finish_outputs()


def test_a_cancel_inside_an_iteration_says_how_far_and_where_the_rest_is(tmp_path):
    """The line of a cancel that lands inside an iteration said only "will stop at the end
    of its current iteration"; the job's job.json then said "did not finish (failed)"."""
    service = _service(tmp_path)
    spec = {"model": f"{HERE}:gated_net", "dataset": "synthetic_vectors", "iterations": 1000,
            "batch_size": 8, "name": "gated"}
    (job_id,) = service.handle({"op": "submit", "job": spec})["submitted"]
    service.executor.close()  # run() returns once the job ended
    ENTERED.clear()
    RELEASE.clear()
    GATE["armed"] = True
    runner = threading.Thread(target=service.executor.run)
    runner.start()
    try:
        assert ENTERED.wait(60)  # inside its first iteration
        message = service.handle({"op": "cancel", "id": job_id})["message"]
    finally:
        GATE["armed"] = False
        RELEASE.set()
        runner.join(60)
        service.finish_outputs()
    assert message.startswith(f"{job_id} will stop at the end of its current iteration "
                              "(iteration 1 of 1000); `accelopt status` then shows it "
                              "cancelled")
    (row,) = service.status()["jobs"]
    assert row["state"] == "cancelled" and row["done"] == 1
    doc = _strict(tmp_path / "root" / "jobs" / job_id / "job.json")["job"]
    assert doc["status"] == "cancelled"
    assert doc["quality_note"] == "the job did not finish (cancelled)"


def test_a_wait_the_stopping_service_cuts_off_is_told_so_not_to_submit_again():
    """A ``wait`` still waiting when the server closed got the submit's answer ("... accepts
    no new jobs); submit to a new one")."""
    from test_salus_service import reply_cut_off_by_close

    reply = reply_cut_off_by_close(b'{"op": "wait", "id": "001-a", "timeout_s": 1000}\n',
                                   {"status": "failed"})
    assert reply["ok"] is False
    assert reply["error"].startswith("the service stopped while this wait ran, before the "
                                     "job ended")
    assert "submit" not in reply["error"]
