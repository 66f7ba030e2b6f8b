"""`accelopt serve`'s requests refused or answered as they are: a job name too long for a file
name, a submit the client stopped waiting for, a workload given as a path, a ``wait`` on a
cancelled job, and a factory's ``args`` that are no keyword arguments. In-process (a
:class:`Service`, its executor closed and run to its end), never synchronised by sleeps."""

from __future__ import annotations

import socket

import pytest
from accelopt_plugins.salus import cli, service
from test_salus_service_edges import _run_to_end, _service

from accelopt import UserError
from accelopt.errors import ConfigError
from accelopt.job.specs import check_job_name

pytestmark = pytest.mark.timeout(120)
TINY = {"model": "mlp", "iterations": 3, "width": 16, "batch_size": 8, "seed": 3}
LONG_NAME = "模" * 90  # 90 characters, 270 bytes in UTF-8: over a file name's 255


def test_a_name_over_a_file_names_bytes_is_refused_in_bytes():
    with pytest.raises(ConfigError, match="200 bytes in UTF-8") as info:
        check_job_name(LONG_NAME)
    assert "\n" not in str(info.value)
    check_job_name("模" * 60)  # 180 bytes: a file name with its id and suffix fits


def test_a_job_named_over_the_byte_limit_is_refused_and_never_runs(tmp_path):
    """It was taken by the executor, then its directory failed with a raw `File name too
    long`: the client read an OSError and the job ran with nowhere to write."""
    svc = _service(tmp_path)
    try:
        with pytest.raises(UserError, match="bytes") as info:
            svc.handle({"op": "submit", "job": {**TINY, "name": LONG_NAME}})
        assert "\n" not in str(info.value)
        assert svc.executor.snapshot() == []
    finally:
        _run_to_end(svc)


def test_a_job_whose_directory_cannot_be_made_is_not_taken(tmp_path):
    """The directory is made before the executor takes the job: a refused submit leaves no
    running job (and takes no number)."""
    svc = _service(tmp_path)
    try:
        (tmp_path / "root").mkdir()
        (tmp_path / "root" / "jobs").write_text("not a directory")
        with pytest.raises(UserError, match="cannot be made.*no job of this submit was taken"):
            svc.handle({"op": "submit", "job": {**TINY, "name": "a"}})
        assert svc.executor.snapshot() == []
        (tmp_path / "root" / "jobs").unlink()
        (job_id,) = svc.handle({"op": "submit", "job": {**TINY, "name": "a"}})["submitted"]
        assert job_id == "001-a"
    finally:
        _run_to_end(svc)


def test_a_submit_left_unanswered_says_it_may_have_been_taken(tmp_path):
    """The service took the job while profiling outlasted the client's wait; a plain "did
    not answer" (exit 2) read as a failure and the job was submitted twice."""
    path = tmp_path / "q.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(1)  # connects, never answers
        with pytest.raises(UserError) as info:
            service.request(path, {"op": "submit", "job": TINY}, timeout_s=0.2)
        assert "may still have been taken" in str(info.value)
        assert "accelopt status" in str(info.value)
        with pytest.raises(UserError) as other:  # any other op: nothing to check
            service.request(path, {"op": "status"}, timeout_s=0.2)
        assert str(other.value) == f"the service on {path} did not answer within 0.2 s"


def test_the_submit_client_waits_longer_than_other_requests(monkeypatch):
    waits: dict[str, float] = {}

    def answer(path, message, timeout_s=30.0):
        waits[message["op"]] = timeout_s
        return {"ok": True, "submitted": ["001-mlp"], "message": "x"}

    monkeypatch.setattr(service, "request", answer)
    cli.submit_cmd(["model=mlp"])
    cli.cancel_cmd(["1"])
    assert waits["submit"] >= 300 and waits["cancel"] == 30.0


@pytest.mark.parametrize("name", ["../config", "workload/../tiny", "/etc/passwd", "tiny.yaml"])
def test_a_workload_is_a_built_in_name_never_a_path(tmp_path, name):
    """`--workload ../config` loaded the run's config as a workload: a multi-line
    ConfigKeyError and a traceback in the service's output."""
    svc = _service(tmp_path)
    try:
        with pytest.raises(UserError, match=r"unknown workload .*built-in workloads: .*tiny"
                           ) as info:
            svc.handle({"op": "submit", "workload": name})
        assert "\n" not in str(info.value)
        assert svc.executor.snapshot() == []
    finally:
        _run_to_end(svc)


def test_wait_on_a_cancelled_job_says_cancelled(tmp_path):
    """`wait` answered "failed" where `status` and job.json said "cancelled"."""
    svc = _service(tmp_path)
    try:
        (job_id,) = svc.handle({"op": "submit", "job": {**TINY, "name": "c"}})["submitted"]
        svc.handle({"op": "cancel", "id": job_id})
        assert svc.handle({"op": "wait", "id": job_id, "timeout_s": 60})["status"] == "cancelled"
        assert svc.handle({"op": "wait", "id": "1", "timeout_s": 60})["status"] == "cancelled"
        (row,) = svc.status()["jobs"]
        assert row["state"] == "cancelled"
    finally:
        _run_to_end(svc)


@pytest.mark.parametrize("args", [[1], "x", 3, {1: 2}])
def test_factory_args_that_are_no_keyword_arguments_are_the_requests_mistake(tmp_path, capsys,
                                                                              args):
    """`"args": [1]` was blamed on the factory ("raised TypeError") with a traceback."""
    svc = _service(tmp_path)
    try:
        with pytest.raises(UserError, match='"args" are the factory\'s keyword arguments') \
                as info:
            svc.handle({"op": "submit", "factory": "os:getcwd", "args": args})
        assert "raised" not in str(info.value) and "\n" not in str(info.value)
        assert "Traceback" not in capsys.readouterr().err
        assert svc.executor.snapshot() == []
    finally:
        _run_to_end(svc)
