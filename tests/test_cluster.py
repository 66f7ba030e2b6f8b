"""Cluster runs end to end: real processes, real gloo, on 127.0.0.1.

Tiny model (mlp width 32), 2 workers + 1 server, a few iterations: each run costs a few
seconds, mostly process start-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from cluster_models import watchdog_verdict
from omegaconf import OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.drivers.cluster import RankFailed, run_cluster
from accelopt.drivers.cluster.transport import HEADER_BYTES
from accelopt.errors import ConfigError, PluginHookError, UserError
from accelopt.job import Job

pytestmark = pytest.mark.timeout(120)
TESTS = str(Path(__file__).parent)
ITERATIONS = 4
# float32 sums in a different order: each worker's mean over its half of the batch, then a
# weighted sum, vs one mean over the whole batch. Each step differs by a few ulps; after a
# few SGD steps on values of order 0.1 the drift stays far below 1e-5.
ATOL, RTOL = 1e-5, 1e-4


def make_cfg(mode: str, iterations: int = ITERATIONS, plugins: dict | None = None, **cluster):
    cfg = OmegaConf.structured(AccelConfig)
    cfg.workload.jobs = [OmegaConf.structured(JobConfig(
        name="tiny", model="mlp", width=32, batch_size=16, iterations=iterations, seed=0))]
    cfg.cluster.mode = mode
    cfg.cluster.workers = 2
    cfg.cluster.servers = 1
    cfg.cluster.timeout_s = 20
    for key, value in cluster.items():
        OmegaConf.update(cfg, f"cluster.{key}", value)
    if plugins:
        cfg.plugins = plugins
    return cfg


@pytest.fixture
def test_plugins(monkeypatch):
    """Let the spawned ranks import tests/cluster_plugins.py."""
    monkeypatch.setenv("PYTHONPATH", TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def use(*names: str) -> None:
        monkeypatch.setenv("ACCELOPT_PLUGINS", ",".join(f"cluster_plugins:{n}" for n in names))

    return use


def single_process(cfg, iterations: int = ITERATIONS):
    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig),
                                               cfg.workload.jobs[0]))
    job = Job(spec, job_id="single", device=torch.device("cpu"))
    losses = [job.step().loss for _ in range(iterations)]
    return job, losses


def assert_same_params(job, state):
    for name, param in job.model.named_parameters():
        torch.testing.assert_close(state[name], param.detach(), atol=ATOL, rtol=RTOL)


def _is_mp_helper(proc) -> bool:
    """Python's multiprocessing helpers, one each per interpreter: the resource tracker
    (started by the first in-process spawn, e.g. the tictac forward-only harness test) and
    the session's forkserver (``conftest.py``), both alive until the session ends. Neither
    is a rank, so neither is a leak; a rank the forkserver forked is (it shares the
    forkserver's command line, so only this process's own children count as helpers)."""
    try:
        cmdline = " ".join(proc.cmdline())
        own = proc.ppid() == os.getpid()
    except psutil.Error:
        return False
    return own and ("multiprocessing.resource_tracker" in cmdline
                    or "multiprocessing.forkserver" in cmdline)


def no_children_left(wait_s: float = 5.0):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        alive = [p for p in psutil.Process().children(recursive=True) if p.is_running()
                 and p.status() != psutil.STATUS_ZOMBIE and not _is_mp_helper(p)]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _wait_for(event) -> None:
    event.wait(30)


def test_no_children_left_sees_a_rank_forked_by_the_sessions_forkserver():
    from accelopt.drivers.processes import rank_context

    ctx = rank_context()
    release = ctx.Event()
    child = ctx.Process(target=_wait_for, args=(release,))
    child.start()
    try:
        assert not no_children_left(wait_s=0.2)
    finally:
        release.set()
        child.join(30)
    assert no_children_left()


def _ctrl_c() -> str:
    """What Ctrl-C does to this process: ``raises`` (KeyboardInterrupt), ``ignored``, or
    ``other`` (a handler of its own)."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler:
        return "raises"
    return "ignored" if handler is signal.SIG_IGN else "other"


def _report_collector(conn) -> None:
    import gc

    conn.send((gc.isenabled(), gc.get_freeze_count(), "torch._dynamo" in sys.modules,
               _ctrl_c()))
    conn.close()


def _collector_of_a_rank(ddp: bool) -> tuple[bool, int, bool, str]:
    """(collector on, objects frozen, dynamo imported, what Ctrl-C does) in a
    rank forked by a forkserver started
    for ``ddp``. A forkserver left running (the session's) is stopped first, and one with
    its preload is running again after, so later tests fork from one as before."""
    from multiprocessing import forkserver

    from accelopt.drivers.processes import rank_context, stop_forkserver

    was_running = forkserver._forkserver._forkserver_pid is not None
    stop_forkserver(forkserver._forkserver)
    ctx = rank_context({"allreduce"} if ddp else {"ps"})
    here, there = ctx.Pipe()
    child = ctx.Process(target=_report_collector, args=(there,))
    child.start()
    try:
        return here.recv()
    finally:
        child.join(30)
        stop_forkserver(forkserver._forkserver)
        if was_running:
            rank_context({"ps"})
            forkserver.ensure_running()


def test_a_rank_starts_with_the_preloaded_imports_frozen_and_the_collector_on():
    """The forkserver imports torch and the runtime with the collector paused and freezes
    them (``drivers/rank_preload.py``); a rank's collections then skip those objects. It
    does not import dynamo, which nothing in a parameter-server rank needs
    (``drivers/lazy_dynamo.py``); for all-reduce ranks, whose DDP imports it, it does."""
    # the preload ignores Ctrl-C only while it imports: a rank does with it what this
    # process does (a new interpreter raises KeyboardInterrupt, unless it was started with
    # SIGINT ignored, as a shell starts a background job, which it inherits)
    expected = "ignored" if _ctrl_c() == "ignored" else "raises"
    enabled, frozen, dynamo, sigint = _collector_of_a_rank(ddp=False)
    assert enabled and not dynamo
    assert sigint == expected
    assert frozen > 100_000  # torch's and the runtime's objects (~200,000 here)
    enabled, frozen_ddp, dynamo, sigint = _collector_of_a_rank(ddp=True)
    assert enabled and dynamo and sigint == expected
    assert frozen_ddp > frozen + 100_000  # dynamo's too (~320,000 in all here)


@pytest.mark.parametrize("preload", ["rank_preload", "rank_preload_ddp"])
def test_a_preload_that_fails_to_import_hands_ctrl_c_back(preload):
    """The forkserver passes over a preload's ImportError: the preload must not leave Ctrl-C
    ignored for every rank forked after it."""
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)  # however it started\n"
            "sys.modules['accelopt.drivers.cluster.launch'] = None  # its import now fails\n"
            "sys.modules['torch._dynamo'] = None\n"
            "try:\n"
            f"    import accelopt.drivers.{preload}\n"
            "except ImportError:\n"
            "    pass\n"
            "else:\n"
            "    sys.exit('the import did not fail')\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.timeout(120)
def test_ps_equals_single_process_and_counts_every_byte(tmp_path):
    cfg = make_cfg("ps")
    before_ranks, jobs_ended = [], []
    out = run_cluster(cfg, run_dir=tmp_path, while_ranks_start=lambda: before_ranks.append(1),
                      when_jobs_end=lambda: jobs_ended.append(1))
    assert before_ranks == [1]  # the launcher's own work for after the run, done once
    assert jobs_ended == [1]  # told once that the jobs ended, before run_cluster returned
    job, losses = single_process(cfg)
    assert_same_params(job, out.state)
    assert out.results[0].losses == pytest.approx(losses, abs=1e-5)
    assert out.results[0].status == "done" and out.results[0].samples == 16 * ITERATIONS

    m = out.metrics
    n_params = len(list(job.model.parameters()))
    param_bytes = sum(p.numel() * p.element_size() for p in job.model.parameters())
    assert m["param_bytes"] == param_bytes
    # every parameter to every worker and every gradient back, each its own transfer
    assert m["transfers"] == 2 * 2 * n_params * ITERATIONS
    payload = sum(r.stats.payload_bytes for r in out.ranks) / ITERATIONS
    assert payload == 2 * 2 * param_bytes
    # on the wire: the model's bytes (payload) + one header per transfer, exactly
    headers = 2 * 2 * n_params * HEADER_BYTES
    assert m["bytes_per_iteration"] == m["expected_bytes_per_iteration"] + headers
    assert m["worker_bytes_per_iteration"] == m["bytes_per_iteration"]  # headers too
    assert abs(payload / m["expected_bytes_per_iteration"] - 1) < 0.01

    processes = {s.process for s in out.spans}
    assert processes == {"rank 0 (server)", "rank 1 (worker)", "rank 2 (worker)"}
    tracks = {(s.process, s.track) for s in out.spans}
    assert ("rank 1 (worker)", "compute") in tracks and ("rank 1 (worker)", "link 0->1") in tracks
    assert ("rank 0 (server)", "link 2->0") in tracks
    for key in ("mc_s", "pc_s", "iteration_makespan_s", "efficiency_e", "ratio_a", "iterations_per_s",
                "mc_s_with_warmup", "achieved_bandwidth_bps"):
        assert key in m, key
    assert len(out.per_iteration) == 2 * ITERATIONS


def test_a_ps_worker_waits_for_each_layers_parameters_not_for_all(tmp_path, test_plugins):
    """Per-layer waits, not a wait for every parameter: a worker computes its first layer
    while its last parameter is still held on the receiving side, in every iteration. (Read
    from the timeline before, the check depended on timing: under load every transfer could
    arrive before forward began, and it failed.)"""
    test_plugins("HOLD_LAST")
    out = run_cluster(make_cfg("ps", plugins={"hold_last": {}}), run_dir=tmp_path)
    rows = {r.metrics["rank"]: r.metrics for r in out.plugin_rows if r.plugin == "hold_last"}
    for rank in ("1", "2"):
        assert rows[rank]["held"] == ITERATIONS  # every iteration pulls
        assert rows[rank]["early"] == rows[rank]["held"]


@pytest.mark.timeout(120)
def test_allreduce_equals_single_process_with_buckets_overlapping_backward(tmp_path):
    cfg = make_cfg("allreduce", bucket_mb=0.001)  # ~1 KB: the mlp's layers fall in 3 buckets
    out = run_cluster(cfg, run_dir=tmp_path)
    job, losses = single_process(cfg)
    assert_same_params(job, out.state)
    assert out.results[0].losses == pytest.approx(losses, abs=1e-5)
    buckets = {s.name for s in out.spans if s.category == "comm"}
    assert len(buckets) >= 3
    # at least one bucket's all-reduce started before that rank's backward ended
    for rank in (0, 1):
        backward = [s for s in out.spans if s.process == f"rank {rank} (worker)"
                    and s.name == "backward"]
        comm = [s for s in out.spans if s.category == "comm" and s.args["source"] == rank]
        assert any(c.start_s < b.end_s for b in backward for c in comm
                   if c.args["iteration"] == b.args["iteration"])
        # backward's compute ends when DDP takes the last bucket; the rest of backward() is
        # DDP waiting for the reductions, a wait span (else Pc counted it and E read ~1)
        waits = {s.args["iteration"]: s for s in out.spans
                 if s.process == f"rank {rank} (worker)" and s.name == "wait all-reduce"}
        assert sorted(waits) == list(range(ITERATIONS))
        for b in backward:
            wait = waits[b.args["iteration"]]
            assert wait.track == "wait" and 0 <= wait.start_s - b.end_s < 0.05


@pytest.mark.timeout(120)
def test_transfer_order_from_a_plugin_is_enforced(tmp_path, test_plugins):
    test_plugins("REVERSE")
    out = run_cluster(make_cfg("ps", iterations=2, plugins={"reverse_order": {}}), run_dir=tmp_path)
    server, worker = out.ranks[0], out.ranks[1]
    names = [name for name, _ in single_process(make_cfg("ps"), 0)[0].model.named_parameters()]
    for it in range(2):
        for dest in (1, 2):
            started = [t for (i, d, _, t) in server.stats.started_log if i == it and d == dest]
            assert started == list(reversed(names))
        # and they arrived in that order
        arrived = [t for (i, s, _, t) in worker.stats.arrival_log if i == it and s == 0]
        assert arrived == list(reversed(names))
        # workers' gradients too, although autograd produces them last layer first anyway
        grads = [t for (i, d, _, t) in worker.stats.started_log if i == it and d == 0]
        assert grads == list(reversed(names))
    assert out.metrics["out_of_order_fraction"] == 0
    assert out.metrics["transfers_ordered"] == out.metrics["transfers"]
    assert any(r.plugin == "reverse_order" for r in out.plugin_rows)
    assert len([r for r in out.plugin_rows if r.plugin == "reverse_order"]) == 1  # deduplicated


@pytest.mark.timeout(120)
def test_an_order_naming_a_missing_transfer_fails_clearly(tmp_path, test_plugins):
    test_plugins("BOGUS")
    cfg = make_cfg("ps", iterations=2, plugins={"bogus_order": {}}, timeout_s=6)
    start = time.monotonic()
    jobs_ended = []
    with pytest.raises(RankFailed) as info:
        run_cluster(cfg, run_dir=tmp_path, when_jobs_end=lambda: jobs_ended.append(1))
    assert jobs_ended == []  # the jobs never ended: nothing to start for the outputs
    message = str(info.value)
    assert "\n" not in message
    assert "rank 0 (server" in message and "TransferOrderError" in message
    assert "'no.such.tensor' (priority 0)" in message and "iteration 0" in message
    assert time.monotonic() - start < 30
    assert no_children_left()


@pytest.mark.timeout(120)
def test_transfer_done_is_called_once_per_received_transfer(tmp_path, test_plugins):
    test_plugins("COUNT_DONE", "RANK_SAYS")
    cfg = make_cfg("ps", iterations=2, plugins={"count_done": {}, "rank_says": {}})
    out = run_cluster(cfg, run_dir=tmp_path)
    # a run-scoped plugin's rows come from one rank (the first worker), not one per rank,
    # saying so where another rank's differ (the server's too); a job-scoped plugin's rows
    # from every rank
    assert [r.summary for r in out.plugin_rows if r.plugin == "rank_says"] == [
        "measured on rank 1 (rank 1's; other ranks' rows differ)"]
    assert out.ranks[0].job_scoped == ["count_done"]
    rows = {r.metrics["rank"]: r.metrics for r in out.plugin_rows if r.plugin == "count_done"}
    n_params = len(list(single_process(cfg, iterations=0)[0].model.parameters()))
    # accelopt_transfer_done runs on the receiver: each worker receives every parameter each
    # iteration, the one server receives every gradient from both workers
    assert rows["1"]["done"] == rows["2"]["done"] == n_params * 2
    assert rows["0"]["done"] == 2 * n_params * 2
    assert all(r["negative"] == 0 for r in rows.values())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trace_hooks", [True, False], ids=["traced", "untraced"])
def test_every_ranks_hook_calls_are_on_its_hooks_track(tmp_path, test_plugins, trace_hooks):
    """A cluster run's timeline had no hook spans (only a one-process run's did), so a slow
    plugin hook on a rank showed only as a slower run. Each rank now records its hook calls
    as a one-process run does, on the run's clock, under ``run.trace_hooks``."""
    test_plugins("COUNT_DONE")
    cfg = make_cfg("ps", iterations=2, plugins={"count_done": {}})
    cfg.run.trace_hooks = trace_hooks
    out = run_cluster(cfg, run_dir=tmp_path)
    hooks = [s for s in out.spans if s.track == "hooks"]
    if not trace_hooks:
        assert hooks == []
        return
    n_params = len(list(single_process(cfg, iterations=0)[0].model.parameters()))
    done = {rank: [s for s in hooks if s.process == f"rank {rank} ({role})"
                   and s.name == "accelopt_transfer_done"]
            for rank, role in ((0, "server"), (1, "worker"), (2, "worker"))}
    # the receiver's calls: each worker receives every parameter each iteration, the server
    # every gradient from both workers
    assert [len(done[r]) for r in (0, 1, 2)] == [2 * n_params * 2, n_params * 2, n_params * 2]
    # on the run's clock: inside the iterations' span of the timeline, not perf_counter's
    iterations = [s for s in out.spans if s.category == "iteration"]
    first = min(s.start_s for s in iterations)
    last = max(s.end_s for s in iterations)
    assert all(first - 1.0 <= s.start_s <= s.end_s <= last + 1.0 for s in hooks)
    assert all(s.category == "hook" for s in hooks)


def test_a_blocking_hook_on_a_rank_is_named_in_the_runs_log(tmp_path, test_plugins):
    """The watchdog runs on every rank, and a spawned rank's warnings reach the run's
    ``accelopt.log`` (they reached only the terminal), each naming its rank."""
    test_plugins("WAITS_FOR_WATCHDOG")
    cfg = make_cfg("ps", iterations=2, plugins={"waits_for_watchdog": {}})
    cfg.run.hook_watchdog_s = 0.2
    run_cluster(cfg, run_dir=tmp_path)
    log = (tmp_path / "accelopt.log").read_text()
    for who in ("rank 0 (server)", "rank 1 (worker)", "rank 2 (worker)"):
        assert (f"[accelopt.watchdog][WARNING] - {who}: plugin 'waits_for_watchdog' has been "
                "in accelopt_iteration_end for") in log


def test_codec_and_filter_plugins_transform_payloads(tmp_path, test_plugins):
    """accelopt_transfer_encode / accelopt_transfer_decode change the payload on the wire;
    accelopt_transfer_filter drops the bias gradients."""
    test_plugins("HALF", "DROP_BIAS")
    cfg = make_cfg("ps", iterations=2, plugins={"half_codec": {}, "drop_bias": {}})
    out = run_cluster(cfg, run_dir=tmp_path)
    job, _ = single_process(cfg, iterations=2)
    m = out.metrics
    # bias gradients dropped (3 biases x 2 workers x 2 iterations); half-precision payloads
    assert m["transfers_dropped"] == 3 * 2 * 2
    payload = sum(r.stats.payload_bytes for r in out.ranks) / 2
    assert payload < 0.75 * 2 * 2 * m["param_bytes"]
    params = dict(job.model.named_parameters())
    for name, value in out.state.items():
        if name.endswith("weight"):  # fp16 round trip: close, not equal
            torch.testing.assert_close(value, params[name].detach(), atol=2e-3, rtol=1e-2)


def test_a_stopped_run_waits_for_a_rank_that_is_writing_its_timeline(tmp_path, monkeypatch):
    """Under load a rank took longer than the wait to pickle its timeline, and the kill cut
    every rank's off: a rank that has started writing is given longer; one that has not,
    the short wait."""
    import types

    from accelopt.drivers.cluster import launch
    from accelopt.drivers.cluster.rank import so_far_path

    monkeypatch.setattr(launch, "SO_FAR_WAIT_S", 0.05)
    monkeypatch.setattr(launch, "SO_FAR_WRITE_S", 30.0)
    alive = types.SimpleNamespace(exitcode=None)
    children = [types.SimpleNamespace(rank=r, process=alive) for r in (1, 2)]
    final = so_far_path(tmp_path, 1)
    temp = final.with_name(f".{final.name}.123.abcd.tmp")
    temp.write_bytes(b"")  # rank 1 is writing; rank 2 never starts

    def finish() -> None:
        time.sleep(0.3)
        temp.rename(final)

    writer = threading.Thread(target=finish)
    writer.start()
    started = time.monotonic()
    launch._await_so_far(children, str(tmp_path))
    writer.join()
    assert final.exists() and 0.25 < time.monotonic() - started < 5


def test_a_decoder_giving_back_a_tensor_of_another_size_is_refused(tmp_path, test_plugins):
    """A parameter server copies parameters from what the decoders give back: a decoder's
    one-element tensor broadcast into every weight, and the run trained a collapsed model
    to "done" in silence (all-reduce refused the same answer)."""
    test_plugins("COLLAPSES")
    cfg = make_cfg("ps", iterations=2, plugins={"collapses": {}})
    with pytest.raises(RankFailed, match=r"plugin 'collapses' answered accelopt_transfer_decode "
                       r"with Tensor .*; expected the tensor accelopt_transfer_encode replaced "
                       r"for transfer '.+' \(\d+ bytes\), got 1 elements of torch.float32 "
                       r"\(4 bytes\)") as info:
        run_cluster(cfg, run_dir=tmp_path)
    assert "\n" not in str(info.value)


def test_a_run_started_while_a_rank_is_being_started_says_to_guard_the_call(monkeypatch,
                                                                           tmp_path):
    """A script calling accelopt at its top level, run again by each rank's import of it,
    ended with multiprocessing's screen of text per rank; each rank now says what to do."""
    import multiprocessing

    from accelopt.errors import UserError

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(UserError, match=r'put that call under `if __name__ == "__main__":`'):
        run_cluster(make_cfg("ps", iterations=1), run_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing started


def test_an_encoder_without_a_decoder_giving_another_size_is_refused(tmp_path, test_plugins):
    """With no decoder, what an encoder gives is what the server sums: a one-element
    gradient broadcast into every parameter's and the run ended "done" (the size check ran
    only on a decoder's answer). Refused on the sender, naming the encoder."""
    test_plugins("SHRINKS")
    cfg = make_cfg("ps", iterations=2, plugins={"shrinks": {}})
    with pytest.raises(RankFailed, match=r"plugin 'shrinks' answered accelopt_transfer_encode "
                       r"with Tensor .*; expected the tensor .* \(\d+ bytes\), got 1 elements "
                       r"of torch.float32 \(4 bytes\): no plugin implements "
                       r"accelopt_transfer_decode to turn it back") as info:
        run_cluster(cfg, run_dir=tmp_path)
    assert "\n" not in str(info.value)


def _signal_rank_2_at_iteration_2(test_plugins, tmp_path: Path, sig: int, timeout_s: float
                                  ) -> tuple[RankFailed, dict[str, float]]:
    """Run a PS job whose rank 2 pauses at iteration 2 and writes its pid; send it ``sig``
    then; return the run's error and {"pid", "at": when the signal went}."""
    import signal as signals

    test_plugins("PAUSE")
    pid_file = tmp_path / "pid"
    cfg = make_cfg("ps", iterations=6, timeout_s=timeout_s,
                   plugins={"pause_rank": {"rank": 2, "iteration": 2, "pid_file": str(pid_file)}})
    sent: dict[str, float] = {}

    def send() -> None:
        deadline = time.monotonic() + 90
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sent["pid"] = int(pid_file.read_text())
        sent["at"] = time.monotonic()
        os.kill(int(sent["pid"]), signals.Signals(sig))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    with pytest.raises(RankFailed) as info:
        run_cluster(cfg, run_dir=tmp_path)
    thread.join(5)
    return info.value, sent


@pytest.mark.timeout(120)
def test_sigkill_of_a_worker_fails_the_run_fast_and_leaves_nothing(test_plugins, tmp_path):
    error, killed = _signal_rank_2_at_iteration_2(test_plugins, tmp_path, 9, timeout_s=60)
    failed_at = time.monotonic()
    message = str(error)
    assert "\n" not in message
    assert f"rank 2 (worker, pid {int(killed['pid'])}) was killed by SIGKILL at iteration 2 " \
        "of job 'tiny'" in message  # read from its progress record: a killed rank says nothing
    assert error.rank == 2 and error.iteration == 2 and error.job_id == "00-tiny"
    assert failed_at - killed["at"] < 30
    assert no_children_left()


@pytest.mark.timeout(120)
def test_a_failed_run_called_from_python_exits_with_its_one_error(tmp_path):
    """A script calling run_cluster (as the benchmarks do) whose rank fails shows that
    failure and nothing else at exit: no 'leaked semaphore' warning, no traceback per
    multiprocessing semaphore (the run's events were released before it stopped the
    resource tracker it had started)."""
    import subprocess

    script = tmp_path / "fails.py"
    script.write_text(
        "from omegaconf import OmegaConf\n"
        "from accelopt.config import AccelConfig, JobConfig\n"
        "from accelopt.drivers.cluster import run_cluster\n"
        "if __name__ == '__main__':\n"
        "    cfg = OmegaConf.structured(AccelConfig)\n"
        "    cfg.workload.jobs = [OmegaConf.structured(JobConfig(name='tiny', model='mlp',\n"
        "        width=32, batch_size=16, iterations=4, seed=0, lr=1e30))]\n"
        "    cfg.cluster.mode = 'allreduce'\n"
        "    cfg.cluster.workers = 2\n"
        "    cfg.plugins = {'gradcomm': {'dtype': 'fp16'}}\n"
        f"    run_cluster(cfg, run_dir={str(tmp_path / 'run')!r})\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 1
    assert "NonFiniteGradient" in out.stderr.strip().splitlines()[-1]
    assert out.stderr.count("Traceback") == 1, out.stderr[-3000:]
    assert "leaked semaphore" not in out.stderr


@pytest.mark.timeout(120)
def test_a_link_probe_called_from_python_leaves_no_leaked_semaphore():
    """``measure_bandwidth`` (tictac's link, the benchmarks' shaper check) stops the resource
    tracker it started; its event must be released first, or every probe printed "There
    appear to be 5 leaked semaphore objects" (the test fails without the release)."""
    import subprocess

    code = ("from accelopt.drivers.cluster.probe import measure_bandwidth\n"
            "if __name__ == '__main__':\n"
            "    rates = measure_bandwidth(None, nbytes=2**16, repeats=2)\n"
            "    print(len(rates))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2"], done.stdout
    assert "leaked semaphore" not in done.stderr, done.stderr[-2000:]


class _Stop(Exception):
    pass


def test_while_ranks_start_runs_before_any_rank_is_forked(tmp_path):
    """Called with no rank process alive; an error in it stops the run, no rank started."""
    seen = []

    def before() -> None:
        seen.extend(p for p in psutil.Process().children(recursive=True)
                    if p.is_running() and not _is_mp_helper(p))
        raise _Stop

    with pytest.raises(_Stop):
        run_cluster(make_cfg("ps"), run_dir=tmp_path, while_ranks_start=before)
    assert seen == []
    assert no_children_left(wait_s=0.5)
    assert not list(tmp_path.iterdir())


def test_the_jobs_end_call_is_made_whenever_the_leader_said_so_before_the_ranks_went():
    """``when_jobs_end`` runs on a thread that may not have woken yet when the ranks are gone:
    an event the leader set still gets its call; one never set gets none."""
    from accelopt.drivers.cluster.launch import _WhenSet

    for _ in range(50):
        ended, calls = threading.Event(), []
        waiter = _WhenSet(ended, lambda calls=calls: calls.append(1))
        ended.set()
        waiter.stop()
        assert calls == [1]
    calls = []
    _WhenSet(threading.Event(), lambda: calls.append(1)).stop()
    assert calls == []


def test_config_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="cluster.mode"):
        run_cluster(make_cfg("mesh"), run_dir=tmp_path)
    cfg = make_cfg("ps")
    cfg.workload.jobs[0].batch_size = 1
    with pytest.raises(ConfigError, match="batch_size 1 is smaller than cluster.workers=2"):
        run_cluster(cfg, run_dir=tmp_path)


@pytest.mark.parametrize("release", [True, False])
def test_a_process_that_ends_with_os_exit_leaves_no_temporary_directory(release, tmp_path):
    """The ``accelopt`` command and the ranks end with ``os._exit``; multiprocessing's
    ``pymp-*`` directory (the forkserver's socket is made in it) is removed first. Without
    the release it stays (the test can fail): one per ``accelopt run``, before."""
    import subprocess

    code = ("import os\n"
            "from multiprocessing import util\n"
            "from accelopt.drivers.processes import release_before_exit\n"
            "print(util.get_temp_dir(), flush=True)\n"
            + ("release_before_exit()\n" if release else "")
            + "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    made = Path(done.stdout.strip())
    assert made.parent == tmp_path and made.name.startswith("pymp-")
    assert made.exists() is not release


@pytest.mark.parametrize("release", [True, False])
def test_a_process_that_ends_with_os_exit_leaves_no_leaked_semaphore(release):
    """Ranks and the ``accelopt`` command end with ``os._exit``; a named semaphore a library
    made there (tqdm's lock, made by ``torch.fx.Interpreter`` in tictac's measurement) is
    released first instead of reported by the resource tracker as leaked. Without the
    release the tracker does report it (the test can fail)."""
    import subprocess

    code = ("import multiprocessing, os\n"
            "from accelopt.drivers.processes import release_before_exit\n"
            "lock = multiprocessing.get_context('spawn').Lock()\n"
            + ("release_before_exit()\n" if release else "")
            + "os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0
    assert ("leaked semaphore" in done.stderr) is not release, done.stderr


@pytest.mark.timeout(150)
def test_ranks_do_not_outlive_a_sigkilled_launcher(tmp_path):
    """The ranks fork from the forkserver, so the kernel's parent-death signal watches the
    forkserver, not the launcher: a launcher killed by SIGKILL (the OOM killer, a CI
    timeout) left the forkserver and three ranks training on at full CPU."""
    import subprocess

    from clirun import accelopt_cmd, cli_env

    launcher = subprocess.Popen(  # its temporary directories, which a SIGKILLed process
        # cannot remove, go under tmp_path
        accelopt_cmd("run", "workload=single", "workload.jobs.0.iterations=1000000",
                     "cluster.mode=ps", "cluster.timeout_s=30", "run.progress=false"),
        cwd=tmp_path, env={**cli_env(), "TMPDIR": str(tmp_path)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    me = psutil.Process(launcher.pid)
    deadline = time.monotonic() + 90
    ranks: list[psutil.Process] = []
    while time.monotonic() < deadline and len(ranks) < 3:  # the forkserver's children
        try:
            ranks = [p for p in me.children(recursive=True) if p.ppid() != launcher.pid]
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    everything = me.children(recursive=True)
    assert len(ranks) >= 3, "the ranks never started"
    launcher.kill()
    launcher.wait(10)
    gone, alive = psutil.wait_procs(everything, timeout=20)
    for p in alive:  # leave nothing behind whatever the outcome
        p.kill()
    assert not [p for p in alive if p in ranks], "ranks outlived their launcher"
    assert not alive, f"{len(alive)} processes outlived their launcher"


@pytest.mark.timeout(120)
def test_a_rank_that_stops_responding_is_named_not_only_the_peer_that_timed_out(
        test_plugins, tmp_path):
    """A SIGSTOPped rank (a debugger, a paused container) made its peers time out, and the
    error named the peer that timed out first, not the rank that stopped."""
    error, stopped = _signal_rank_2_at_iteration_2(test_plugins, tmp_path, 19, timeout_s=5)
    assert f"rank 2 (worker, pid {int(stopped['pid'])}) had not exited when its peers gave " \
           "up" in str(error)
    assert error.rank == 2 and "\n" not in str(error)
    assert no_children_left()


def test_a_ranks_progress_record_says_which_jobs_iteration_it_was_in(tmp_path):
    """The record is rewritten whole each time: a job of a shorter name after a longer one
    leaves nothing of the longer behind; a name with quotes and spaces survives."""
    from accelopt.drivers.cluster import faults

    progress = faults.Progress(tmp_path, 3)
    assert faults.Progress.read_at(tmp_path, 3) == faults.At(None)
    progress.set(41, "00-a-long-job-name", "a long 'job' name")
    progress.set(7, "01-b", "b")
    assert faults.Progress.read_at(tmp_path, 3) == faults.At(7, "01-b", "b")
    progress.set(8, "02-c", "c" * 2000)  # a name too long for the record: the id is kept
    assert faults.Progress.read_at(tmp_path, 3) == faults.At(8, "02-c", "")
    progress.set(7, "01-b", "b")
    assert faults.Progress.read(tmp_path, 3) == 7 and progress.iteration == 7
    progress.jobs_ended()
    assert faults.where(faults.Progress.read(tmp_path, 3), "b") == "after its jobs ended"
    error = watchdog_verdict(tmp_path, [1, 1, 1], {2: RuntimeError("boom")}, iteration=5,
                       job=("01-b", "b"))
    assert str(error) == ("rank 2 (worker, pid 102) raised RuntimeError: boom at iteration 5 "
                          "of job 'b'; the cluster run was stopped")
    assert error.job_id == "01-b"  # the job's own code raised: that job failed
    assert error.exit_code == 3  # as one process exits when a job fails alone
    hooked = PluginHookError("slow", "accelopt_iteration_end", RuntimeError("boom"))
    error = watchdog_verdict(tmp_path, [1, 1, 1], {2: hooked}, iteration=5, job=("01-b", "b"))
    assert "in hook accelopt_iteration_end: RuntimeError: boom at iteration 5 of job 'b'" \
        in str(error)
    assert error.job_id == ""  # a plugin's error stops the run, whichever job's iteration
    assert error.exit_code == 1  # a plugin raised
    misfit = UserError("the model's output (a dict with keys scores) has no logits ...")
    error = watchdog_verdict(tmp_path, [1, 1, 1], {2: misfit}, iteration=0, job=("01-b", "b"))
    # the job's own output: its error, and the exit code of a job that failed (one process
    # ends the same job's failure with 3, the run going on without it)
    assert error.job_id == "01-b" and error.exit_code == 3
    # a user error reads as one: the problem and its fix first (not "rank 2 (...) raised
    # UserError: ..."), where the rank was after it, the job named once
    assert str(error) == ("the model's output (a dict with keys scores) has no logits ... "
                          "(rank 2, worker, at iteration 0 of job 'b'; the cluster run was "
                          "stopped)")
    named = UserError("job 'b': w got no gradient in iteration 0; freeze it")
    error = watchdog_verdict(tmp_path, [1, 1, 1], {2: named}, iteration=0, job=("01-b", "b"))
    assert str(error) == ("job 'b': w got no gradient in iteration 0; freeze it (rank 2, "
                          "worker, at iteration 0; the cluster run was stopped)")


def test_a_rank_that_exits_without_an_exception_is_named_before_its_peers_resets(tmp_path):
    """os._exit(7) on rank 2: its peers' "connection reset/closed by peer" (the transport's
    error in PS mode, gloo's own in all-reduce) was named as the cause, rank 2 not at all."""
    from accelopt.drivers.cluster.transport import CommunicationError

    reset = CommunicationError("rank 0: receiving from rank 2 at iteration 19: RuntimeError: "
                               "[../gloo/transport/tcp/pair.cc:537] Read error: Connection "
                               "reset by peer")
    closed = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    error = watchdog_verdict(tmp_path, [1, 1, 7], {0: reset, 1: closed})
    assert str(error).startswith("rank 2 (worker, pid 102) exited with code 7 at iteration 19")
    assert error.rank == 2


def test_a_rank_stuck_before_its_first_iteration_is_named_after_gloos_plain_timeout(
        tmp_path, monkeypatch):
    """gloo's timeout outside the transport (before the first iteration) is a plain
    RuntimeError: it counted as the cause itself, and the rank still running, the one its
    peers waited for, was never named."""
    from accelopt.drivers.cluster import faults

    monkeypatch.setattr(faults, "GRACE_S", 0.05)
    timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
                           "Timed out waiting 10000ms for send operation to complete")
    error = watchdog_verdict(tmp_path, [1, 1, None], {0: timeout, 1: timeout}, iteration=None)
    assert ("rank 2 (worker, pid 102) had not exited when its peers gave up, before its first "
            "iteration") in str(error)
    assert error.rank == 2


def test_a_killed_forkserver_is_named_not_rank_0_exiting_with_255(tmp_path, monkeypatch):
    """Ranks die with their forkserver (parent-death signal) and multiprocessing, unable to
    read their status, reports 255 for each: "rank 0 exited with code 255"."""
    import subprocess

    from accelopt.drivers.cluster import faults

    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid is gone, as a killed forkserver's is
    monkeypatch.setattr(faults, "_forkserver_pid", lambda children: ended.pid)
    error = watchdog_verdict(tmp_path, [255, 255, 255], {})
    assert str(error).startswith(f"the ranks' forkserver (their parent process, pid "
                                 f"{ended.pid}) died at iteration 19")
    assert "code 255" not in str(error)


@pytest.mark.timeout(120)
def test_a_rendezvous_port_in_use_is_one_line_with_the_fix(tmp_path):
    """Something else listens on cluster.master_port: the line was rank 0's raw
    DistNetworkError, exit 1, and blamed rank 1, merely still starting, as the one its
    peers waited for."""
    import socket

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RankFailed) as info:
            run_cluster(make_cfg("ps", iterations=1, master_port=port, timeout_s=10),
                        run_dir=tmp_path)
    assert str(info.value) == (
        f"the rendezvous port {port} (cluster.master_port) is already in use by another "
        "process; set cluster.master_port=0 to pick a free port, or choose another")
    # bad input, as in one process: `except accelopt.UserError` catches it in every mode
    assert info.value.exit_code == 2 and isinstance(info.value, UserError)
    assert no_children_left()


def test_a_failure_line_gives_the_iteration_its_error_names_once():
    """A PS worker receives iteration 3's parameters while its progress still says 2: the
    line read "receiving from rank 0 at iteration 3: ... at iteration 2 of job 'x'"."""
    from accelopt.drivers.cluster.faults import JOBS_ENDED, raised_line

    error = ("CommunicationError: rank 1: receiving from rank 0 at iteration 3: "
             "RuntimeError: timed out")
    line = raised_line(1, "worker", 11, error, 2, "tiny-mlp")
    assert line == ("rank 1 (worker, pid 11) raised CommunicationError: rank 1: receiving "
                    "from rank 0: RuntimeError: timed out at iteration 3 of job 'tiny-mlp'; "
                    "the cluster run was stopped")
    assert line.count("iteration") == 1
    assert raised_line(1, "worker", 11, "RuntimeError: boom", 2) == (
        "rank 1 (worker, pid 11) raised RuntimeError: boom at iteration 2; the cluster run "
        "was stopped")
    ended = raised_line(1, "worker", 11, error, JOBS_ENDED)
    assert ended.endswith("after its jobs ended; the cluster run was stopped")


def test_a_rank_stuck_in_a_plugin_hook_is_named_in_the_runs_line(tmp_path):
    """Rank 0's hook watchdog named a plugin hook that had run for long; its peers timed
    out waiting. The line blamed a worker's timeout and said rank 0 "may be the one": it
    names the hook now."""
    from accelopt.drivers.cluster import faults
    from accelopt.drivers.cluster.transport import CommunicationError

    faults.Progress(tmp_path, 0).hook_blocked(
        "rank 0 (server): plugin 'hang' has been in accelopt_transfer_done for 2.0 s (thread "
        "recv 1, /x/hang.py:12); a hook that blocks stalls the work it runs in")
    timeout = CommunicationError("rank 1: receiving from rank 0 at iteration 3: timed out")
    error = watchdog_verdict(tmp_path, [None, 1], {1: timeout}, iteration=3)
    line = str(error)
    assert line.startswith("rank 0 (server, pid 100) was stuck in a plugin hook at iteration "
                           "3: plugin 'hang' has been in accelopt_transfer_done for 2.0 s "
                           "(hook watchdog), and its peers gave up waiting: rank 1 (worker")
    assert "may be the one" not in line and "\n" not in line
    assert error.rank == 0 and "stuck in a plugin hook" in error.cause
