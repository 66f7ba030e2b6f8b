"""The executor's scheduling, admission and failure behaviour, on real tiny jobs."""

from __future__ import annotations

import pytest
import torch
from plugins_for_tests import BOOM, LANES, LIFO, REJECT, SABOTAGE, WRAP, TimesTwo

from accelopt.errors import PluginHookError
from accelopt.job.profile import persistent_tensors, tensor_bytes

TWO_JOBS_SAME_ARRIVAL = [
    "workload.jobs.1.arrival_s=0.0",
]


def _lane_order(record) -> list[str]:
    return [s.args["job"] for s in record.spans if s.category == "iteration"]


def test_default_is_fifo_one_job_at_a_time(run_tiny):
    record = run_tiny()
    order = _lane_order(record)
    assert order == ["tiny-mlp"] * 6 + ["tiny-cnn"] * 4
    assert all(j.status == "done" for j in record.jobs)
    assert {j.lane for j in record.jobs} == {"default"}
    # one lane: iterations never overlap in time
    spans = sorted((s for s in record.spans if s.category == "iteration"), key=lambda s: s.start_s)
    assert all(a.end_s <= b.start_s for a, b in zip(spans, spans[1:], strict=False))


def test_select_next_hook_picks_the_job(run_tiny):
    record = run_tiny(LIFO, overrides=TWO_JOBS_SAME_ARRIVAL)
    order = _lane_order(record)
    # both arrive at 0; LIFO prefers the later id (tiny-cnn) and runs it first
    assert order[:4] == ["tiny-cnn"] * 4
    assert order[4:] == ["tiny-mlp"] * 6
    assert any(r.plugin == "lifo" for r in record.plugin_rows)


def test_deferred_job_admitted_when_memory_is_released(run_tiny):
    record = run_tiny(LANES, overrides=TWO_JOBS_SAME_ARRIVAL)
    by_name = {j.job.name: j for j in record.jobs}
    assert all(j.status == "done" for j in record.jobs)
    first, second = by_name["tiny-mlp"], by_name["tiny-cnn"]
    assert first.lane != second.lane
    # capacity 1: the second job starts only after the first one finished
    assert second.first_start_s >= first.end_s


def test_lanes_run_concurrently_when_admitted_together(run_tiny):
    record = run_tiny(LANES, overrides=[*TWO_JOBS_SAME_ARRIVAL, "plugins.lanes.capacity_jobs=2",
                                        "workload.jobs.0.iterations=40",
                                        "workload.jobs.1.iterations=40"])
    tracks = {s.track for s in record.spans if s.category == "iteration"}
    assert len(tracks) == 2
    a, b = (j for j in record.jobs)
    # the two jobs' lifetimes overlap: real concurrency, not one after another
    assert a.first_start_s < b.end_s and b.first_start_s < a.end_s


def test_rejected_job_is_reported_not_run(run_tiny):
    record = run_tiny(REJECT)
    assert [j.status for j in record.jobs] == ["rejected", "rejected"]
    assert all("too big" in j.error for j in record.jobs)
    assert not [s for s in record.spans if s.category == "iteration"]
    # no JCT for a job that never ran (it had one: the time to the refusal, in the CSV)
    assert all(j.jct_s is None and j.end_s is not None for j in record.jobs)
    import io

    from rich.console import Console

    from accelopt.report.summary import render_summary

    out = io.StringIO()
    render_summary(record, Console(file=out, width=200))
    assert "Run: 0/2 done, 0 failed, 2 rejected" in out.getvalue()  # it read "0 failed" only


def test_impossible_memory_budget_rejected_with_amount(run_tiny):
    record = run_tiny(overrides=["run.memory_capacity=1KiB"])
    assert all(j.status == "rejected" for j in record.jobs)
    assert "too much" in record.jobs[0].error and "memory_capacity" in record.jobs[0].error


def test_plugin_exception_names_plugin_and_hook(run_tiny):
    with pytest.raises(PluginHookError) as info:
        run_tiny(BOOM)
    assert info.value.plugin == "boom"
    assert info.value.hook == "accelopt_iteration_end"
    assert "boom" in str(info.value)


def test_failing_job_fails_alone(run_tiny):
    # profiling runs 5 forwards on a deep copy (with its own call counter), so the real
    # model raises on its own 6th forward: after five completed iterations
    record = run_tiny(SABOTAGE, overrides=["plugins.sabotage.fail_at=6",
                                           "workload.jobs.0.iterations=10"])
    by_name = {j.job.name: j for j in record.jobs}
    failed = by_name["tiny-mlp"]
    assert failed.status == "failed"
    assert "injected failure" in failed.error
    assert failed.iterations_done == 5
    assert by_name["tiny-cnn"].status == "done"


def test_a_learning_rate_past_the_dtype_is_named_not_the_inputs(run_tiny):
    """lr=1e39 overflows float32 in the optimizer's first step: the line said "check that
    the model takes the dataset's inputs", which were fine."""
    record = run_tiny(overrides=["workload.jobs.0.lr=1e39"])
    failed = next(j for j in record.jobs if j.job.name == "tiny-mlp")
    assert failed.status == "failed" and "without overflow" in failed.error
    assert "check the job's lr (1e+39), momentum and weight_decay" in failed.error
    assert "dataset's inputs" not in failed.error


def test_job_failing_while_profiled_fails_alone(run_tiny):
    from accelopt.report.metrics import run_metrics

    record = run_tiny(SABOTAGE, overrides=["plugins.sabotage.fail_at=2"])
    failed = next(j for j in record.jobs if j.job.name == "tiny-mlp")
    assert failed.status == "failed" and failed.error.startswith(
        "a step measuring its memory, before training, raised ")
    done = next(j for j in record.jobs if j.job.name == "tiny-cnn")
    assert done.status == "done"
    # it never ran on the run's clock: no end there, no JCT, and the makespan is the
    # other job's, from its own arrival (one that never ran stretches it by neither)
    assert failed.end_s is None and failed.jct_s is None and failed.iterations_done == 0
    assert run_metrics(record)["makespan_s"] == pytest.approx(done.end_s - done.job.arrival_s)


def test_layer_build_hook_replaces_layers_once_at_build(run_tiny):
    from accelopt.config import JobConfig
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs

    plugin = WRAP.instantiate()
    host = PluginHost([(WRAP, plugin)])
    (job,) = build_jobs([JobConfig(name="m", model="mlp", width=8)], torch.device("cpu"), host)
    wrapped = [m for m in job.model.modules() if isinstance(m, TimesTwo)]
    assert len(wrapped) == 3  # two hidden Linear layers and the head
    paths = [o.path for o in plugin.offers]
    assert paths[-1] == "" and len(paths) == len(set(paths))  # each offered exactly once
    before = len(plugin.offers)
    job.step()
    assert len(plugin.offers) == before  # nothing pluggy-related runs per forward


def test_profile_persistent_bytes_are_exact(run_tiny):
    record = run_tiny()
    from accelopt.config import JobConfig
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs

    (job,) = build_jobs([JobConfig(name="m", model="mlp", width=32, optimizer="adam", lr=1e-3)],
                        torch.device("cpu"), PluginHost())
    from accelopt.job.profile import measure_profile

    before = {k: v.clone() for k, v in job.model.state_dict().items()}
    profile = measure_profile(job)
    # measuring does not move the real job
    assert job.iteration == 0
    assert all(torch.equal(before[k], v) for k, v in job.model.state_dict().items())
    params = sum(p.numel() * p.element_size() for p in job.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in job.model.buffers())
    # parameters + gradients + Adam's exp_avg and exp_avg_sq (+ one scalar step per param)
    n_params = len(list(job.model.parameters()))
    expected = params + buffers + params + 2 * params + n_params * 4
    assert profile.persistent_bytes == expected
    assert profile.ephemeral_bytes > 0 and profile.iteration_seconds > 0
    assert profile.peak_bytes == profile.persistent_bytes + profile.ephemeral_bytes
    job.step()
    assert tensor_bytes(persistent_tensors(job)) == profile.persistent_bytes
    assert record.jobs[0].job.profile is not None


def test_inference_job_runs_forward_only(run_tiny):
    record = run_tiny(overrides=["workload.jobs.0.kind=infer"])
    infer = next(j for j in record.jobs if j.job.name == "tiny-mlp")
    assert infer.status == "done" and infer.job.kind == "infer"
    assert infer.final_loss is None and infer.samples == 6 * 16
    assert infer.job.profile.persistent_bytes > 0  # parameters only: no grads, no optimizer


def test_generated_trace_workload_runs(run_tiny):
    record = run_tiny(workload="trace", overrides=[
        "workload.generate.n_jobs=3", "workload.generate.max_iterations=4",
        "workload.generate.min_iterations=2", "workload.generate.mean_interarrival_s=0.01",
        "workload.generate.models=[mlp,lstm]",
    ])
    assert len(record.jobs) == 3
    assert all(j.status == "done" for j in record.jobs)
    arrivals = [j.job.arrival_s for j in record.jobs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0


def test_open_executor_takes_submissions_and_cancels():
    """keep_open: the service form of the executor (used by `accelopt serve`)."""
    import threading

    from accelopt.config import JobConfig
    from accelopt.drivers.local import CANCELLED, Executor
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs

    host = PluginHost()
    executor = Executor(host, [], capacity_bytes=None, device="cpu", keep_open=True)
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(executor.run()))
    runner.start()
    try:
        short, long = build_jobs(
            [JobConfig(name="short", width=8, iterations=3),
             JobConfig(name="long", width=8, iterations=100000)],
            torch.device("cpu"), host)
        executor.submit(short)
        assert executor.wait(short.info.job_id, timeout_s=60) == "done"
        executor.submit(long)
        message = executor.cancel(long.info.job_id)
        assert long.info.job_id in message
        assert executor.wait(long.info.job_id, timeout_s=60) == "failed"
        with pytest.raises(Exception, match="already submitted"):
            executor.submit(short)
    finally:
        executor.close()
        runner.join(timeout=60)
    assert not runner.is_alive()
    by_name = {r.job.name: r for r in results}
    assert by_name["short"].status == "done" and by_name["short"].iterations_done == 3
    assert by_name["long"].error == CANCELLED and by_name["long"].iterations_done < 100000
    assert [info.name for info, _, _ in executor.snapshot()] == ["short", "long"]


def test_a_job_submitted_before_the_clock_starts_arrives_when_it_starts(monkeypatch):
    """A job submitted to an open executor before run() (a service's ready callback) kept
    its arrival on the constructor's clock; run() then restarted the clock, so the job
    ended before it arrived: a negative JCT (-10 s here)."""
    import threading

    from accelopt.config import JobConfig
    from accelopt.drivers import local
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs

    now = [100.0]
    monkeypatch.setattr(local.time, "perf_counter", lambda: now[0])
    host = PluginHost()
    executor = local.Executor(host, [], capacity_bytes=None, device="cpu", keep_open=True)
    monkeypatch.undo()  # the executor keeps the fake clock; nothing else sees it
    (job,) = build_jobs([JobConfig(name="early", width=8, iterations=2)],
                        torch.device("cpu"), host)
    now[0] = 110.0
    executor.submit(job)
    now[0] = 120.0
    runner = threading.Thread(target=executor.run)
    runner.start()
    try:
        assert executor.wait(job.info.job_id, timeout_s=60) == "done"
    finally:
        executor.close()
        runner.join(timeout=60)
    ((info, result, _),) = executor.snapshot()
    assert info.arrival_s == 0.0 and result.jct_s is not None and result.jct_s >= 0


def test_lane_threads_use_the_runs_thread_count(run_tiny):
    """OpenMP thread counts are per OS thread: lanes must inherit run.threads."""
    from accelopt import PluginSpec, hookimpl

    seen: list[int] = []

    class Probe:
        @hookimpl
        def accelopt_iteration_start(self, context):
            seen.append(torch.get_num_threads())  # called in the lane's thread

    previous = torch.get_num_threads()
    try:
        run_tiny(PluginSpec(name="thread_probe", factory=lambda c: Probe()),
                 overrides=["run.threads=1"])
    finally:
        torch.set_num_threads(previous)
    assert seen and set(seen) == {1}


def test_the_iteration_end_hooks_time_is_the_iterations_as_iteration_starts_is():
    """Work a plugin does in ``accelopt_iteration_end`` ended outside the iteration (its span,
    service time and samples/s), so 0.2 s per iteration there read as free while the same
    work in ``accelopt_iteration_start`` counted; the hook itself still sees the iteration's
    own end. The driver counts it by timing the whole step (the step makes one result)."""
    from accelopt import PluginSpec, hookimpl
    from accelopt.config import JobConfig
    from accelopt.drivers.local import Executor
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs

    clock = [0.0]
    seen: list[tuple[float, float]] = []

    class SlowEnd:
        @hookimpl
        def accelopt_iteration_end(self, context, result) -> None:  # 5 s, on a fake clock
            seen.append((result.start_s, result.end_s))
            clock[0] += 5.0

    host = PluginHost([(PluginSpec(name="slow_end", factory=lambda c: SlowEnd()), SlowEnd())])
    (job,) = build_jobs([JobConfig(name="j", model="mlp", width=4, batch_size=4,
                                   iterations=2)], torch.device("cpu"), host)
    executor = Executor(host, [job], capacity_bytes=None, device="cpu", profiler=None,
                        clock=lambda: clock[0])
    (result,) = executor.run()
    assert seen == [(0.0, 0.0), (5.0, 5.0)]  # the hook sees the iteration as it ended
    assert result.service_s == 10.0  # and its time is the iteration's
    assert [(s.start_s, s.end_s) for s in executor.spans] == [(0.0, 5.0), (5.0, 10.0)]


def test_the_clock_and_the_telemetry_origin_start_after_the_jobs_are_profiled():
    """The telemetry sampler started before the jobs were profiled, the spans' clock after:
    its samples lay seconds off the iterations on the timeline (the profiling time)."""
    import time

    from accelopt.config import JobConfig
    from accelopt.drivers.local import Executor
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs
    from accelopt.job.profile import measure_profile

    profiled: list[float] = []
    started: list[float] = []

    def profiler(job):
        profile = measure_profile(job)
        profiled.append(time.perf_counter())
        return profile

    host = PluginHost([])
    jobs = build_jobs([JobConfig(name=n, model="mlp", width=4, batch_size=4, iterations=2)
                       for n in ("a", "b")], torch.device("cpu"), host)
    executor = Executor(host, jobs, capacity_bytes=None, device="cpu", profiler=profiler,
                        on_clock_start=started.append)
    executor.run()
    assert len(profiled) == 2 and started == [executor.clock_started]
    assert started[0] >= max(profiled)  # the origin the sampler is given: after profiling


def test_the_telemetry_backend_is_probed_before_the_clock_starts(monkeypatch):
    """The sampler probed NVML/psutil in start(), which the executor calls once its clock
    has started: the probing (5-26 ms) was in the queueing delay, JCT and makespan of the
    jobs arriving at 0. Wired as a run wires it, the probe comes before the clock."""
    import time

    from accelopt.config import JobConfig
    from accelopt.drivers.local import Executor
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs
    from accelopt.telemetry import TelemetrySampler

    probed: list[float] = []
    real = TelemetrySampler._init_nvml

    def probe(self):
        probed.append(time.perf_counter())
        return real(self)

    monkeypatch.setattr(TelemetrySampler, "_init_nvml", probe)
    host = PluginHost([])
    jobs = build_jobs([JobConfig(name="a", model="mlp", width=4, batch_size=4, iterations=2)],
                      torch.device("cpu"), host)
    sampler = TelemetrySampler(interval_s=60.0)
    executor = Executor(host, jobs, capacity_bytes=None, device="cpu",
                        on_clock_start=sampler.start)
    executor.run()
    samples = sampler.stop()
    assert len(probed) == 1 and probed[0] < executor.clock_started
    assert len(samples) == 2  # shorter than one interval: its start and its end


def test_a_job_refused_at_submit_is_never_reported_as_ended():
    """A submitted job whose profiling raised was refused, yet recorded as failed and given
    to on_finish: the service wrote its job.json into the number the next job then took."""
    from accelopt.config import JobConfig
    from accelopt.drivers.local import Executor
    from accelopt.errors import UserError
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs

    def profiler(job):
        raise RuntimeError("its forward raised")

    finished: list[str] = []
    host = PluginHost([])
    (job,) = build_jobs([JobConfig(name="y", model="mlp", width=4, batch_size=4, iterations=2)],
                        torch.device("cpu"), host)
    executor = Executor(host, [], capacity_bytes=None, device="cpu", profiler=profiler,
                        on_finish=lambda job, result: finished.append(job.info.job_id),
                        keep_open=True)
    with pytest.raises(UserError, match="job 'y' refused: a step measuring its memory"):
        executor.submit(job)
    assert finished == [] and executor.snapshot() == []


def test_a_plugin_cannot_change_the_run_config_it_is_configured_with(run_tiny):
    """``accelopt_configure``'s ``run_config`` is for reading: a change took effect (a job
    trained 2 iterations instead of 6, config.yaml recording 2). Now it raises in the hook,
    named, and the config is writable again afterwards for the core."""
    from accelopt import PluginSpec, hookimpl

    class Shortens:
        def __init__(self, _config=None) -> None:
            pass

        @hookimpl
        def accelopt_configure(self, config, run_config):
            run_config.workload.jobs[0].iterations = 2

    with pytest.raises(PluginHookError, match="plugin 'shortens' raised in hook "
                       "accelopt_configure: ReadonlyConfigError"):
        run_tiny(PluginSpec(name="shortens", factory=Shortens), overrides=["cluster.mode=none"])


ONE_JOB = ["workload.jobs=[{name:solo,model:mlp,width:8,batch_size:8,iterations:3,seed:1}]"]


def _where_hooks_run() -> tuple[object, list[tuple[str, str, bool]]]:
    """A plugin recording, for each call, the hook, the calling thread's name and whether
    that thread held the hook lock."""
    import threading

    from accelopt import PluginSpec, hookimpl
    from accelopt.host import HOOK_LOCK

    seen: list[tuple[str, str, bool]] = []

    def note(hook: str) -> None:
        seen.append((hook, threading.current_thread().name, HOOK_LOCK._is_owned()))

    class Where:
        @hookimpl
        def accelopt_allocate(self, request):
            note(f"allocate {request.phase}")

        @hookimpl
        def accelopt_iteration_start(self, context):
            note("iteration_start")

        @hookimpl
        def accelopt_after_forward(self, context, loss):
            note("after_forward")

        @hookimpl
        def accelopt_before_optimizer_step(self, context, gradients):
            note("before_optimizer_step")

        @hookimpl
        def accelopt_after_step(self, context, stepped):
            note("after_step")

        @hookimpl
        def accelopt_iteration_end(self, context, result):
            note("iteration_end")

        @hookimpl
        def accelopt_run_end(self, run, metrics):
            note("run_end")

    return PluginSpec(name="where", factory=lambda c: Where()), seen


def test_one_job_runs_on_the_callers_thread_and_its_events_skip_the_hook_lock(run_tiny):
    """A single job in one process needs no lane thread (its tensors would pay glibc's
    per-thread arena) and no hook lock (that thread makes every hook call)."""
    import threading

    spec, seen = _where_hooks_run()
    record = run_tiny(spec, overrides=ONE_JOB)
    assert [j.status for j in record.jobs] == ["done"]
    me = threading.current_thread().name
    events = [s for s in seen if s[0] != "run_end"]
    assert len([s for s in events if s[0] == "iteration_end"]) == 3
    assert {(thread, locked) for _, thread, locked in events} == {(me, False)}
    assert ("run_end", me, True) in seen  # hooks called once per run keep the lock


def test_several_jobs_run_on_lane_threads_and_every_hook_call_takes_the_lock(run_tiny):
    spec, seen = _where_hooks_run()
    run_tiny(spec)
    iteration = [s for s in seen if s[0] in ("iteration_start", "after_step", "iteration_end",
                                             "allocate iteration")]
    assert len([s for s in iteration if s[0] == "iteration_end"]) == 10
    assert {(thread, locked) for _, thread, locked in iteration} == {("lane-default", True)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("jobs", [ONE_JOB, []], ids=["one job", "two jobs"])
def test_an_iteration_refused_while_nothing_runs_fails_the_job_without_a_hang(run_tiny, jobs):
    """The allocation hook refuses an iteration while no other iteration runs: nothing could
    ever grant it. The job fails with that reason and the lane goes on to the next job
    (it used to wait on the driver's condition for a wake-up that never came)."""
    from accelopt import PluginSpec, hookimpl
    from accelopt.types import AllocationDecision

    class RefuseIterations:
        @hookimpl
        def accelopt_allocate(self, request):
            if request.phase == "iteration":
                return AllocationDecision(granted=False, reason="waiting for memory")
            return None

    record = run_tiny(PluginSpec(name="refuse", factory=lambda c: RefuseIterations()),
                      overrides=jobs)
    assert record.jobs and {j.status for j in record.jobs} == {"failed"}
    # the plugin that refused and its reason are named (the line named neither)
    assert {j.error for j in record.jobs} == {
        "plugin 'refuse' refused its iteration while nothing else ran (accelopt_allocate, its "
        "reason: 'waiting for memory'): it would wait forever; grant an iteration when no "
        "other runs, or answer None for it"}
    assert all(j.iterations_done == 0 for j in record.jobs)


def test_a_signal_taken_by_a_lane_thread_is_handled_while_the_job_runs():
    """The kernel may deliver a process's signal to any thread; its Python handler then runs
    only when the main thread next runs bytecode. The thread in run() waited on its condition
    without a timeout, so a second Ctrl-C to `accelopt serve` that landed on the lane's
    thread went unhandled until the job ended: the service hung (10^7 iterations)."""
    import signal
    import threading

    from accelopt.config import JobConfig
    from accelopt.drivers.local import Executor
    from accelopt.host import PluginHost
    from accelopt.job import build_jobs

    host = PluginHost()
    handled = threading.Event()
    executor: Executor

    def stop_now(signum, frame):  # as accelopt serve's second Ctrl-C does
        executor.close(stop_now=KeyboardInterrupt())
        handled.set()

    def on_iteration(job, result):  # on the lane's thread: the signal lands there
        if job.iteration == 2:
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            assert handled.wait(timeout=20), "the main thread never ran the signal handler"

    executor = Executor(host, [], capacity_bytes=None, device="cpu", keep_open=True,
                        on_iteration=on_iteration)
    (job,) = build_jobs([JobConfig(name="long", width=8, iterations=1000)],
                        torch.device("cpu"), host)
    executor.submit(job)
    previous = signal.signal(signal.SIGUSR1, stop_now)
    try:
        with pytest.raises(KeyboardInterrupt):
            executor.run()  # on the main thread, as accelopt serve runs it
    finally:
        signal.signal(signal.SIGUSR1, previous)
    (result,) = [r for _, r, _ in executor.snapshot()]
    assert handled.is_set() and result.iterations_done < 100
