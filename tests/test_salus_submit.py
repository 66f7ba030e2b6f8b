"""`accelopt submit` and `accelopt cancel` saying what the service does with a job: a submit
whose parts would be dropped, or whose job can never fit, is refused in one line; a cancel
says whether the job had started and whether its lane was reclaimed; a job that ran no
iteration has no completion time. In-process services: no sockets to wait for, no sleeps."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from accelopt_plugins.salus.service import ServeOptions, Service

from accelopt import UserError

pytestmark = pytest.mark.timeout(60)
TINY = {"model": "mlp", "iterations": 8, "width": 16, "batch_size": 8}


def _service(tmp_path: Path, **options) -> Service:
    return Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root",
                                threads=1, **{"capacity": "256MiB", **options}))


@pytest.mark.parametrize("args, line", [
    (["--workload", "tiny", "iterations=1000", "lr=5", "name=zzz"],
     "submit: --workload submits the workload's own jobs: key=value overrides (iterations, "
     "lr, name) are not applied to them; drop them, or submit one job with model=... and "
     "those keys"),
    (["--workload", "tiny", "--factory", "nomod:fn"],
     "submit: --workload tiny and --factory nomod:fn are two submits; give one of them"),
])
def test_a_workload_submit_with_parts_it_would_drop_is_refused(monkeypatch, args, line):
    """`submit --workload tiny iterations=1000 lr=5 name=zzz` submitted the workload's jobs
    with their own values, exit 0; with `--factory` the factory was never imported. Both are
    refused before anything is sent."""
    from accelopt_plugins.salus import cli, service

    sent = []
    monkeypatch.setattr(service, "request", lambda path, message: sent.append(message) or {
        "ok": True, "submitted": ["001-x"]})
    with pytest.raises(UserError) as info:
        cli.submit_cmd(args)
    assert str(info.value) == line and info.value.exit_code == 2
    assert sent == []


@pytest.mark.parametrize("extra", [{"job": TINY}, {"factory": "m:f"}, {"args": {"lr": 5}}])
def test_a_workload_request_with_other_parts_is_refused(tmp_path, extra):
    """The protocol took "workload" and dropped a "job", "factory" or "args" beside it."""
    service = _service(tmp_path)
    try:
        with pytest.raises(UserError, match="submit"):
            service.handle({"op": "submit", "workload": "tiny", **extra})
        assert service.executor.snapshot() == []
    finally:
        service.executor.close()
    assert list(tmp_path.iterdir()) == []


def test_a_job_that_can_never_fit_is_refused_at_submit(tmp_path):
    """With `--capacity 2MiB`, `submit model=resnet` printed `001-resnet` and exit 0; only
    `status` said it was rejected (needs 6.3 MiB; here an MLP of width 512 needs 4.0). The capacity is fixed and the job is
    profiled at submit: it is refused then, by the admission's own check, taking no number
    and leaving no directory."""
    service = _service(tmp_path, capacity="2MiB", policy="srtf")
    try:
        with pytest.raises(UserError) as info:
            service.handle({"op": "submit", "job": {**TINY, "name": "wide", "width": 512}})
        line = str(info.value)
        assert line.startswith("job 'wide' refused: it needs ") and "\n" not in line
        assert "but the capacity is 2.0 MiB" in line
        assert "raise the capacity (plugins.salus.capacity; accelopt serve --capacity)" in line
        assert service.executor.snapshot() == []
        (job_id,) = service.handle({"op": "submit", "job": {**TINY, "name": "small"}})[
            "submitted"]
    finally:
        service.executor.close()
    assert job_id == "001-small"
    assert [p.name for p in (tmp_path / "root" / "jobs").iterdir()] == ["001-small"]


def test_a_cancel_says_whether_the_job_started_and_whether_its_lane_was_reclaimed(tmp_path):
    """Two jobs share lane L0 (one lane at most); the first is held after its first
    iteration (the per-iteration callback, outside the executor's lock). Cancelling the
    second said "cancelled between iterations; lane L0 reclaimed" though it had run none and
    L0 went on; status showed it a JCT. It started nothing: no JCT, and the line says so."""
    service = _service(tmp_path, policy="fifo", max_lanes=1)
    executor = service.executor
    held, go, first = threading.Event(), threading.Event(), []

    def hold_first(job, result) -> None:
        if not first:
            first.append(job.info.job_id)
            held.set()
            assert go.wait(30)

    executor.on_iteration = hold_first
    runner = threading.Thread(target=executor.run)
    runner.start()  # submitted to a running service, as clients do
    try:
        ids = [service.handle({"op": "submit", "job": {**TINY, "name": name, "iterations": n}})[
            "submitted"][0] for name, n in (("a", 3), ("b", 30))]
        assert held.wait(30)
        (ran,) = first
        (waiting,) = (job_id for job_id in ids if job_id != ran)
        iterations = dict(zip(ids, (3, 30), strict=True))
        with executor.lock:  # the driver admits it into L0 and wakes the lock's waiters
            assert executor.lock.wait_for(lambda: all(
                result.lane == "L0" for _, result, _ in executor.snapshot()), timeout=30)
        assert service.handle({"op": "cancel", "id": waiting})["message"] == (
            f"{waiting} cancelled before it started; it left lane L0, which runs on "
            f"with {ran}")
        assert service.handle({"op": "cancel", "id": ran})["message"] == (
            f"{ran} cancelled after 1 of {iterations[ran]} iterations; it left lane L0, which "
            "was reclaimed")
    finally:
        go.set()
        executor.close()
        runner.join(30)
        service.finish_outputs()
    rows = {row["id"]: row for row in service.status()["jobs"]}
    assert rows[waiting]["state"] == "cancelled" and rows[waiting]["done"] == 0
    assert rows[waiting]["jct_s"] is None
    assert rows[ran]["done"] == 1 and rows[ran]["jct_s"] > 0
    doc = json.loads((tmp_path / "root" / "jobs" / waiting / "job.json").read_text())
    assert doc["job"]["status"] == "cancelled" and doc["job"]["jct_s"] is None


def test_a_job_cancelled_before_it_ran_has_no_jct(tmp_path):
    """A job cancelled before it ran an iteration showed the time to its cancel as its JCT
    (`cancelled │ - │ 0/30 │ JCT 3.97`): it completed nothing."""
    service = _service(tmp_path)
    try:
        (job_id,) = service.handle({"op": "submit", "job": TINY})["submitted"]
        assert service.handle({"op": "cancel", "id": job_id})["message"] == (
            f"{job_id} cancelled before it arrived")
    finally:
        service.executor.close()
        service.finish_outputs()
    (row,) = service.status()["jobs"]
    assert (row["state"], row["done"], row["jct_s"]) == ("cancelled", 0, None)
    doc = json.loads((tmp_path / "root" / "jobs" / job_id / "job.json").read_text())
    assert doc["job"]["jct_s"] is None
