"""`accelopt serve` as a real long-lived process: submit, status, cancel, wait; malformed
requests, killed clients and a second server must not disturb it."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from accelopt_plugins.salus.service import ServeOptions, request, serve

from accelopt import UserError

pytestmark = pytest.mark.timeout(120)
TESTS = Path(__file__).resolve().parent
SERVER = (
    "import sys; from accelopt_plugins.salus.cli import serve_cmd; "
    "sys.exit(serve_cmd(sys.argv[1:]))"
)


def make_job(iterations: int = 5) -> dict:
    """A user's job factory (imported by the server: `--factory test_salus_service:make_job`)."""
    return {"name": "factory-job", "model": "mlp", "iterations": iterations, "width": 16,
            "batch_size": 8, "seed": 3}


def train(steps: int = 1) -> None:
    """A plain training function, not a factory: it builds no job (and returns None)."""
    return None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    sock = tmp / "s.sock"
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, "--socket", str(sock), "--root", str(tmp / "root"),
         "--capacity", "256MiB", "--threads", "1", "--policy", "fair"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    line = proc.stdout.readline()  # blocks until the server says it listens
    assert "listening on" in line, proc.stderr.read()
    assert "accounted, not enforced" in line
    yield sock, tmp / "root", proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def ask(sock: Path, message: dict) -> dict:
    return request(sock, message, timeout_s=60)


def raw(sock: Path, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(sock))
        s.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


TINY = {"model": "mlp", "iterations": 8, "width": 16, "batch_size": 8}


def test_socket_is_owner_only(server):
    sock, _, _ = server
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600


def test_submit_wait_and_outputs_in_the_job_directory(server):
    sock, root, _ = server
    (job_id,) = ask(sock, {"op": "submit", "job": {**TINY, "name": "a"}})["submitted"]
    assert ask(sock, {"op": "wait", "id": job_id})["status"] == "done"
    doc = json.loads((root / "jobs" / job_id / "job.json").read_text())
    assert doc["job"]["status"] == "done" and doc["job"]["iterations"] == 8
    assert len(doc["losses"]) == 8 and doc["job"]["jct_s"] > 0
    assert (root / "jobs" / job_id / "weights.pt").stat().st_size > 0
    # the trained model scored on the held-out set, as `accelopt run` scores it (the
    # service wrote null with no note: a trained job with no quality and no reason)
    assert doc["job"]["quality_metric"] == "accuracy"
    assert 0 <= doc["job"]["quality"] <= 1 and doc["job"]["quality_samples"] > 0
    config = json.loads((root / "jobs" / job_id / "config.json").read_text())
    assert config["arrival_s"] == doc["job"]["arrival_s"]  # one arrival, not two
    status = ask(sock, {"op": "status"})
    row = next(j for j in status["jobs"] if j["id"] == job_id)
    assert row["state"] == "done" and row["done"] == 8 and row["persistent"] > 0
    assert row["quality"] == doc["job"]["quality"] and row["quality_metric"] == "accuracy"
    assert status["note"].startswith("lanes are accounted, not enforced")


@pytest.mark.parametrize("payload, error", [
    (b"this is not json\n", "not JSON"),
    (b"[1, 2, 3]\n", '"op" string'),
    (b'{"op": "frobnicate"}\n', "unknown op"),
    (b'{"op": "submit", "job": {"modell": "cnn"}}\n',
     "unknown key 'modell'; did you mean 'model'? (JobConfig keys: name, model, "),
    (b'{"op": "submit", "job": {"model": "cnn", "iterations": "many"}}\n', "iterations"),
    (b'{"op": "submit", "workload": "nope"}\n', "unknown workload"),
    (b'{"op": "cancel", "id": "no-such-job"}\n', "no job"),
    (b'{"op": "submit", "factory": "no_such_module:f"}\n',
     "the service (pid "),  # it, not the client, imports: the line said "cannot import" only
    (b'{"op": "submit", "factory": "test_salus_service:make_job", "args": {"bogus": 1}}\n',
     "raised TypeError: make_job() got an unexpected keyword argument 'bogus' (its traceback"),
    # a name is part of the job's directory: one that climbs out would write over another's
    (b'{"op": "submit", "job": {"model": "mlp", "name": "../../001-a"}}\n',
     "cannot name the job's files"),
    (b'{"op": "wait", "id": "x", "timeout_s": "abc"}\n', '"timeout_s" must be a number'),
    # a training function given as a factory ran in the service; the line says so
    (b'{"op": "submit", "factory": "test_salus_service:train"}\n',
     "test_salus_service:train returned NoneType, not a job: the service (pid "),
])
def test_malformed_requests_get_an_error_reply_and_the_service_lives(server, payload, error):
    sock, _, proc = server
    reply = raw(sock, payload)
    assert reply["ok"] is False and error in reply["error"]
    assert "\n" not in reply["error"]
    assert ask(sock, {"op": "ping"})["pid"] == proc.pid


def test_a_refused_submit_takes_no_job_number(server):
    """A job refused when it is built (an unknown model) took a number: the next job's id
    skipped it, a gap that reads as a job gone missing."""
    sock, _, _ = server
    (first,) = ask(sock, {"op": "submit", "job": {**TINY, "name": "before"}})["submitted"]
    refused = raw(sock, b'{"op": "submit", "job": {"model": "no_such_model"}}\n')
    assert refused["ok"] is False and "unknown model" in refused["error"]
    (second,) = ask(sock, {"op": "submit", "job": {**TINY, "name": "after"}})["submitted"]
    assert int(second.split("-")[0]) == int(first.split("-")[0]) + 1


def test_killed_clients_do_not_disturb_the_service(server):
    sock, _, proc = server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # half a request, then gone
        s.connect(str(sock))
        s.sendall(b'{"op": "sta')
    client = subprocess.Popen(
        [sys.executable, "-c",
         "import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
         "s.sendall(b'{\"op\": \"status\"'); print('connected', flush=True); "
         "sys.stdin.readline()",
         str(sock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert client.stdout.readline().strip() == "connected"
    client.send_signal(signal.SIGKILL)
    client.wait()
    assert ask(sock, {"op": "ping"})["pid"] == proc.pid
    assert proc.poll() is None


def test_second_serve_on_the_same_socket_refuses(server, tmp_path):
    sock, _, _ = server
    with pytest.raises(UserError, match=r"already running on .*s\.sock"):
        serve(ServeOptions(socket=sock, root=tmp_path))
    assert ask(sock, {"op": "ping"})["ok"]


def test_second_serve_on_the_same_root_refuses(server, tmp_path):
    """Numbering is per root: two services on other sockets numbered into one directory
    from the same last number, the second writing over the first's jobs."""
    sock, root, proc = server
    with pytest.raises(UserError, match=rf"\(pid {proc.pid}\) writes its jobs into --root "
                       ".*; give this one another --root") as info:
        serve(ServeOptions(socket=tmp_path / "other.sock", root=root))
    assert "\n" not in str(info.value)
    assert ask(sock, {"op": "ping"})["ok"]


def test_a_root_the_service_cannot_write_is_refused_at_start(tmp_path):
    from accelopt_plugins.salus.service import Service

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match=r"jobs: .*file is a file, not a directory; give --root a "
                                         r"directory you can write"):
        Service(ServeOptions(socket=tmp_path / "s.sock", root=blocker / "root"))


def test_job_survives_its_client_exiting(server):
    """The real CLI client submits and exits; the job still runs to completion."""
    sock, root, _ = server
    out = subprocess.run(
        [sys.executable, "-m", "accelopt.cli.main", "submit", "--socket", str(sock),
         "model=mlp", "iterations=12", "width=16", "batch_size=8", "name=orphan"],
        capture_output=True, text=True, timeout=90,
    )
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().splitlines()[-1]
    assert job_id.endswith("-orphan")
    assert ask(sock, {"op": "wait", "id": job_id})["status"] == "done"
    assert (root / "jobs" / job_id / "job.json").is_file()


def test_submit_reads_values_as_a_run_does(server, capsys):
    """`accelopt submit 'model_kwargs={hidden:4}'` was refused ("model_kwargs must be a
    mapping, e.g. model_kwargs={num_classes:10}"): only JSON was read. Values are read as
    `accelopt run` reads overrides."""
    from accelopt_plugins.salus.cli import submit_cmd

    sock, root, _ = server
    assert submit_cmd(["--socket", str(sock), "model=byo_models:kw_mlp", "dataset=digits",
                       "model_kwargs={hidden: 4, depth: 2}", "iterations=2", "batch_size=8",
                       "lr=0.05", "name=kwargs"]) == 0
    job_id = capsys.readouterr().out.strip().splitlines()[-1]
    assert ask(sock, {"op": "wait", "id": job_id})["status"] == "done"
    config = json.loads((root / "jobs" / job_id / "config.json").read_text())
    assert config["model_kwargs"] == {"hidden": 4, "depth": 2}
    assert (config["iterations"], config["lr"]) == (2, 0.05)


@pytest.mark.parametrize("item, value", [
    ("m={num_classes:10}", {"num_classes": 10}),
    ('m={"num_classes": 10}', {"num_classes": 10}),  # JSON still reads
    ("m=[1,2]", [1, 2]), ("m=3", 3), ("m=0.1", 0.1), ("m=true", True), ("m=null", None),
    ("m=cnn", "cnn"), ("m=byo_models:kw_mlp", "byo_models:kw_mlp"), ('m="a=b"', "a=b"),
])
def test_submit_values_read_as_overrides(item, value):
    from accelopt_plugins.salus.cli import _key_values

    assert _key_values([item]) == {"m": value}


@pytest.mark.parametrize("item, line", [
    ("name=a=b", "submit: cannot read name='a=b' ("),
    ("lr=0.1,0.2", "submit: lr='0.1,0.2' is a sweep; a submit is one job"),
])
def test_a_submit_value_no_run_reads_is_one_line(item, line):
    from accelopt_plugins.salus.cli import _key_values

    with pytest.raises(UserError) as info:
        _key_values([item])
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_factory_job_and_cancel(server):
    sock, root, _ = server
    (fact,) = ask(sock, {"op": "submit", "factory": "test_salus_service:make_job",
                         "args": {"iterations": 4}})["submitted"]
    (long,) = ask(sock, {"op": "submit", "job": {**TINY, "iterations": 10**7,
                                                 "name": "forever"}})["submitted"]
    assert ask(sock, {"op": "wait", "id": fact})["status"] == "done"
    number = str(int(long.split("-")[0]))  # "3" for 003-forever: as a person types it
    message = ask(sock, {"op": "cancel", "id": number})["message"]
    assert message.startswith(f"{long} ")
    assert ask(sock, {"op": "wait", "id": long})["status"] == "cancelled"
    status = ask(sock, {"op": "status"})
    row = next(j for j in status["jobs"] if j["id"] == long)
    assert row["state"] == "cancelled" and row["done"] < 10**7
    again = ask(sock, {"op": "cancel", "id": long})["message"]
    assert again == f"{long} already cancelled"  # not "already failed"
    assert all(long not in lane["jobs"] for lane in status["lanes"]), "lane reclaimed"
    doc = json.loads((root / "jobs" / long / "job.json").read_text())
    # the state the status table shows (it said "failed": a user's cancel read as a failure)
    assert doc["job"]["status"] == "cancelled" and "cancelled" in doc["job"]["error"]
    assert doc["job"]["quality"] is None and "did not finish" in doc["job"]["quality_note"]


def test_zz_shutdown_lets_the_service_exit(server):
    sock, _, proc = server
    assert "stopping" in ask(sock, {"op": "shutdown"})["message"]
    assert proc.wait(timeout=60) == 0
    assert not sock.exists()


def test_a_restarted_service_numbers_jobs_after_those_it_finds(tmp_path):
    """A service restarted on the same root (after a crash) started again at 001 and wrote
    its first job over the results of the old 001."""
    from accelopt_plugins.salus.service import Service

    old = tmp_path / "root" / "jobs" / "007-mlp"
    old.mkdir(parents=True)
    (old / "job.json").write_text("{}")
    (tmp_path / "root" / "jobs" / "notes").mkdir()  # not a job directory: ignored
    service = Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root",
                                   capacity="256MiB", threads=1))
    try:
        (job_id,) = service.handle({"op": "submit", "job": {**TINY, "name": "mlp"}})["submitted"]
    finally:
        service.executor.close()
    assert job_id == "008-mlp"
    assert (old / "job.json").read_text() == "{}"


def test_threads_beyond_the_cores_are_said_when_the_service_starts(tmp_path, monkeypatch):
    """`accelopt serve --threads 4` on 2 cores was taken silently (as run.threads=4 warns)."""
    from accelopt_plugins.salus.service import Service

    from accelopt.plugin import PluginWarning

    monkeypatch.setattr("accelopt_plugins.salus.plugin.usable_cores", lambda: 2)
    with pytest.warns(PluginWarning, match=r"^--threads=4 x 1 lane\(s\) is 4 threads, more than the 2 "
                      r"cores"):
        service = Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root",
                                       threads=4, policy="fifo"))
    service.executor.close()


def test_closing_the_server_waits_for_the_answers_being_written(tmp_path):
    """The reply to ``shutdown`` was lost now and then: the server closed and the process
    exited while the handler thread (a daemon) was still writing it."""
    import threading

    from accelopt_plugins.salus.service import _Server

    written = threading.Event()
    started = threading.Event()

    class Slow:  # the handler, slowed so that closing overtakes it without the wait
        def __init__(self, request, client_address, server):
            started.set()
            request.recv(100)
            threading.Event().wait(0.3)  # a deliberate delay inside the handler, not a sync
            request.sendall(b'{"ok": true}\n')
            written.set()

    server = _Server(str(tmp_path / "s.sock"), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(tmp_path / "s.sock"))
        client.sendall(b"{}\n")
        assert started.wait(10)
        server.close()
        assert written.is_set()  # closed only once the answer was out
        assert client.recv(100) == b'{"ok": true}\n'


@pytest.mark.parametrize("flags, line", [
    (["--capacity", "abc"], "--capacity: cannot read 'abc' as a size"),
    (["--threads", "-1"], "--threads must be in [0, 1024]"),
    (["--max-lanes", "-5"], "--max-lanes must be -1 (policy default)"),
    (["--device", "tpu"], "--device: unknown device 'tpu'"),
    (["--policy", "zzz"], "--policy: unknown policy 'zzz'; choose one of "),
])
def test_a_bad_flag_is_named_as_given_and_nothing_listens(tmp_path, flags, line):
    """The service checks its flags as salus's settings; the refusal named
    plugins.salus.capacity, a key the user of `accelopt serve` never typed."""
    from accelopt_plugins.salus.cli import serve_cmd

    sock = tmp_path / "s.sock"
    with pytest.raises(UserError) as info:
        serve_cmd(["--socket", str(sock), "--root", str(tmp_path / "root"), *flags])
    assert str(info.value).startswith(line) and "plugins.salus" not in str(info.value)
    assert not sock.exists()


def test_a_socket_path_that_is_not_a_socket_is_left_as_it_is(tmp_path):
    """`accelopt serve --socket notes.txt` deleted the user's notes.txt and put its socket
    there: anything but a socket is refused in one line and kept."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    for path in (notes, tmp_path):
        with pytest.raises(UserError, match=r"is a (file|directory), not a socket, and is left "
                           r"as it is; give --socket a path that is free") as info:
            serve(ServeOptions(socket=path, root=tmp_path / "srv"))
        assert "\n" not in str(info.value)
    assert notes.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # no lock, no root


def test_a_refused_submit_leaves_no_files_and_shares_no_number(tmp_path):
    """A job refused while it was profiled (its model raises) had its job.json written
    (status failed) into 001-y; the next job took 001 too, its directory describing the
    refused one. A refused submit leaves nothing."""
    from accelopt_plugins.salus.service import Service

    service = Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root",
                                   capacity="256MiB", threads=1))
    try:
        with pytest.raises(UserError, match="job 'y' refused: a step measuring its memory"):
            service.handle({"op": "submit", "job": {"name": "y", "model": "byo_models:too_wide",
                                                    "dataset": "digits", "iterations": 2,
                                                    "batch_size": 8}})
        (job_id,) = service.handle({"op": "submit", "job": {**TINY, "name": "z"}})["submitted"]
    finally:
        service.executor.close()
        service.finish_outputs()  # every ended job's files written (the refused one's were)
    assert job_id == "001-z"
    assert [p.name for p in (tmp_path / "root" / "jobs").iterdir()] == ["001-z"]
    assert sorted(p.name for p in (tmp_path / "root" / "jobs" / "001-z").iterdir()) == [
        "config.json"]


def test_a_job_a_killed_service_left_is_failed_and_listed_after_a_restart(tmp_path,
                                                                          monkeypatch):
    """A job running when the service was killed (kill -9) had a config.json and nothing
    else: no job.json, no row in `accelopt status`. The next service on the root marks it
    failed, saying why, and lists it; on exit it removes its socket and lock files."""
    from accelopt_plugins.salus.service import INTERRUPTED

    jobs = tmp_path / "root" / "jobs"
    (jobs / "001-a").mkdir(parents=True)
    (jobs / "001-a" / "job.json").write_text("{}")  # ended: left as it is
    (jobs / "002-b").mkdir()
    (jobs / "002-b" / "config.json").write_text(json.dumps(
        {**TINY, "name": "b", "arrival_s": 1.5}))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # pytest keeps its handlers
    sock, seen = tmp_path / "s.sock", {}

    def ready(line: str) -> None:  # the service listens: ask, then stop it
        seen["status"] = request(sock, {"op": "status"})
        request(sock, {"op": "shutdown"})

    assert serve(ServeOptions(socket=sock, root=tmp_path / "root", capacity="256MiB",
                              threads=1), ready=ready) == 0
    (row,) = seen["status"]["jobs"]
    assert (row["id"], row["state"], row["error"]) == ("002-b", "failed", INTERRUPTED)
    assert row["iterations"] == 8 and row["model"] == "mlp"
    doc = json.loads((jobs / "002-b" / "job.json").read_text())
    assert doc["job"]["status"] == "failed" and doc["job"]["error"] == INTERRUPTED
    assert doc["job"]["name"] == "b" and doc["job"]["arrival_s"] == 1.5
    assert (jobs / "001-a" / "job.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]  # no socket, no lock
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == ["jobs"]


class RaisesOnceAEnded:
    """A policy with a bug: first come first served while job ``a`` is ready, then it raises
    (``--policy test_salus_service:RaisesOnceAEnded``)."""

    max_lanes = 1

    def select(self, lane, ready, now_s):
        if all(state.job.name != "a" for state in ready):
            raise RuntimeError("policy bug")
        return ready[0].job.job_id


def test_a_policy_that_raises_fails_the_unended_jobs_and_keeps_the_ended_ones(tmp_path,
                                                                                monkeypatch):
    """A policy raising mid-service stopped it with the error, leaving the jobs it had taken
    with a config.json and nothing else until the next start. Now each unended job's
    job.json is failed with the error line; the ended job keeps its own; the error is
    raised (the command exits non-zero with it)."""
    from accelopt.errors import AccelOptError

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # pytest keeps its handlers
    sock, ids = tmp_path / "s.sock", []

    def ready(line: str) -> None:  # before the executor runs: all three share one lane
        for name, iterations in (("a", 2), ("b", 50), ("c", 50)):
            ids.extend(request(sock, {"op": "submit", "job": {
                **TINY, "name": name, "iterations": iterations}})["submitted"])

    with pytest.raises(AccelOptError, match="accelopt_select_next") as info:
        serve(ServeOptions(socket=sock, root=tmp_path / "root", capacity="256MiB", threads=1,
                           policy="test_salus_service:RaisesOnceAEnded"), ready=ready)
    line = str(info.value)
    assert "policy bug" in line and "\n" not in line
    jobs = tmp_path / "root" / "jobs"
    docs = {job_id: json.loads((jobs / job_id / "job.json").read_text())["job"]
            for job_id in ids}
    a, b, c = (docs[job_id] for job_id in ids)
    assert a["status"] == "done" and a["error"] == "" and a["iterations"] == 2
    for doc in (b, c):
        assert doc["status"] == "failed"
        assert doc["error"] == f"the service stopped: {line}"
    assert (jobs / ids[0] / "weights.pt").is_file()
    assert not sock.exists()


def _service(tmp_path):
    from accelopt_plugins.salus.service import Service

    return Service(ServeOptions(socket=tmp_path / "s.sock", root=tmp_path / "root",
                                capacity="256MiB", threads=1))


def test_a_submit_the_shutdown_overtakes_while_profiling_is_refused(tmp_path):
    """A submit still being profiled when a shutdown came was added to the executor after
    its run had returned: answered ``submitted``, never run, and failed "killed or crashed"
    by the next service. It is refused, with the add, and leaves no files."""
    service = _service(tmp_path)
    profile = service.executor.profiler

    def shutdown_meanwhile(job):  # the shutdown request arrives during the profiling
        service.handle({"op": "shutdown"})
        return profile(job)

    service.executor.profiler = shutdown_meanwhile
    try:
        with pytest.raises(UserError, match="the service is shutting down and accepts no new "
                           "jobs; submit to a new one"):
            service.handle({"op": "submit", "job": {**TINY, "name": "late"}})
        assert service.executor.snapshot() == []
        assert service.executor.run() == []  # nothing was left for a run that had ended
    finally:
        service.finish_outputs()
    assert list(tmp_path.iterdir()) == []  # no job directory (a Service makes no root itself)


def reply_cut_off_by_close(request: bytes, late_answer: dict) -> dict:
    """The reply a client gets to ``request`` when the server closes (no grace) while the
    service is still answering it; the service's own ``late_answer`` comes only after."""
    import tempfile
    import threading

    from accelopt_plugins.salus.service import _Handler, _Server

    started, release = threading.Event(), threading.Event()

    class Slow:  # a service whose answer comes only after the server closed
        def handle(self, request):
            started.set()
            release.wait(30)
            return late_answer

    with tempfile.TemporaryDirectory() as tmp:  # a short path: sockets' are limited
        path = os.path.join(tmp, "s.sock")
        server = _Server(path, _Handler)
        server.service = Slow()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(30)
            client.connect(path)
            client.sendall(request)
            assert started.wait(30)
            server.close(grace_s=0)
            release.set()  # the late answer is not written after the one close gave
            return json.loads(client.makefile().readline())


def test_a_request_still_running_when_the_server_closes_gets_a_definite_answer():
    """A submit whose profiling outlasted the close's grace got no answer: the client read
    "closed the connection without answering", not knowing whether its job was taken."""
    reply = reply_cut_off_by_close(b'{"op": "submit"}\n', {"submitted": ["001-late"]})
    assert reply["ok"] is False
    assert reply["error"].startswith("the service stopped before answering (it was shutting "
                                     "down and accepts no new jobs)")


def test_a_full_backlog_is_retried_then_said_in_one_line(tmp_path, monkeypatch):
    """16 clients at once: half got a raw ``BlockingIOError: [Errno 11]`` (a backlog of 5,
    and a connect with a timeout does not wait for room). The service's backlog is larger,
    and a client finding it full retries, then says the service is busy."""
    import tempfile

    from accelopt_plugins.salus import service as module

    monkeypatch.setattr(module, "BUSY_RETRY_S", 0.05, raising=False)
    with tempfile.TemporaryDirectory() as tmp, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        path = os.path.join(tmp, "s.sock")
        listener.bind(path)
        listener.listen(0)  # accepts nothing: the backlog fills
        queued = []
        while True:
            waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            waiting.setblocking(False)
            queued.append(waiting)
            try:
                waiting.connect(path)
            except BlockingIOError:
                break
        try:
            with pytest.raises(UserError, match="is busy: it took no new connection") as info:
                request(Path(path), {"op": "ping"}, timeout_s=5)
        finally:
            for waiting in queued:
                waiting.close()
    assert "\n" not in str(info.value)
    assert module._Server.request_queue_size >= 64


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), -1, "60", True])
def test_a_wait_timeout_that_is_no_finite_number_is_one_line(tmp_path, timeout):
    """``"timeout_s": Infinity`` answered OverflowError, its traceback in the service's log."""
    service = _service(tmp_path)
    try:
        with pytest.raises(UserError, match=r'"timeout_s" must be a number of seconds >= 0 '
                           r"\(finite\), got "):
            service.handle({"op": "wait", "id": "1", "timeout_s": timeout})
    finally:
        service.executor.close()


def test_a_huge_wait_timeout_waits_instead_of_overflowing(tmp_path):
    """``"timeout_s": 1e10`` (or 1e308) reached a lock's wait, which takes at most
    ``threading.TIMEOUT_MAX``: OverflowError. A cancel ends the wait."""
    import threading

    from accelopt.drivers.local import Executor

    service = _service(tmp_path)
    try:
        (job_id,) = service.handle({"op": "submit", "job": TINY})["submitted"]
        asked = []
        wait = service.executor.wait

        def recorded(job, timeout_s):
            asked.append(timeout_s)
            return wait(job, timeout_s)

        service.executor.wait = recorded
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(
            service.handle({"op": "wait", "id": job_id, "timeout_s": 1e308})))
        with service.executor.lock:  # held: the waiter waits inside, the cancel comes after
            waiter.start()
            while waiter.is_alive() and not service.executor.lock._waiters:  # in its wait
                service.executor.lock.wait(0)
            service.executor.cancel(job_id)
        waiter.join(30)
        assert answers == [{"status": "cancelled"}]
        assert asked == [threading.TIMEOUT_MAX]
        assert Executor.wait(service.executor, job_id, 1e308) == "failed"
    finally:
        service.executor.close()
        service.finish_outputs()


def test_a_first_signal_stops_accepting_and_a_second_stops_now(tmp_path, capfd):
    """SIGINT and SIGTERM to `accelopt serve` did nothing visible and could not stop it: a
    long job ran on, only SIGKILL ended it, losing its results. The first signal says what
    it waits for and stops accepting; the second stops the jobs and fails the unended."""
    import threading

    from accelopt_plugins.salus.service import _Stopper

    from accelopt.errors import Terminated

    service = _service(tmp_path)
    (job_id,) = service.handle({"op": "submit", "job": {**TINY, "iterations": 10**7}})[
        "submitted"]
    raised = []

    def run() -> None:
        try:
            service.executor.run()
        except BaseException as exc:  # what serve() is given
            raised.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    stop = _Stopper(service)
    try:
        stop(signal.SIGTERM, None)
        assert ("accelopt serve: stopping: waiting for 1 job; signal again to stop now\n"
                in capfd.readouterr().err)
        with pytest.raises(UserError, match="shutting down"):
            service.handle({"op": "submit", "job": TINY})
        stop(signal.SIGTERM, None)
        runner.join(60)
    finally:
        service.executor.close(stop_now=KeyboardInterrupt())  # old code: never ends
        runner.join(60)
    assert not runner.is_alive() and len(raised) == 1 and isinstance(raised[0], Terminated)
    assert service.fail_unended(raised[0]) == [job_id]
    doc = json.loads((tmp_path / "root" / "jobs" / job_id / "job.json").read_text())["job"]
    assert doc["status"] == "failed"
    assert doc["error"] == "the service stopped: terminated (SIGTERM)"
    assert doc["iterations"] < 10**7


def test_ctrl_c_twice_ends_the_service_with_130(tmp_path):
    """The command line's exit status for a service stopped by a second Ctrl-C."""
    sock = tmp_path / "s.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "accelopt.cli.main", "serve", "--socket", str(sock), "--root",
         str(tmp_path / "root"), "--capacity", "256MiB", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "listening on" in proc.stdout.readline(), proc.stderr.read()
        (job_id,) = ask(sock, {"op": "submit", "job": {**TINY, "iterations": 10**7}})[
            "submitted"]
        proc.send_signal(signal.SIGINT)
        assert "stopping: waiting for 1 job; signal again" in proc.stderr.readline()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert "interrupted" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    doc = json.loads((tmp_path / "root" / "jobs" / job_id / "job.json").read_text())["job"]
    assert doc["status"] == "failed" and "interrupted" in doc["error"]
