"""The hook watchdog: a plugin hook that blocks is named in one line, once, and nothing else."""

from __future__ import annotations

import logging
import threading

import pytest

from accelopt import PluginSpec, hookimpl
from accelopt.host import PluginHost
from accelopt.types import IterationContext, JobInfo
from accelopt.watchdog import HookWatchdog, watching

pytestmark = pytest.mark.timeout(120)
JOB = JobInfo("00-j", "j", "mlp", "train", 0.0, 1, 1)


class Blocks:
    """A plugin whose iteration start waits until the test lets it go."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    @hookimpl
    def accelopt_iteration_start(self, context):
        self.entered.set()
        assert self.release.wait(60), "never released"


def _blocked_call(host: PluginHost, plugin: Blocks) -> threading.Thread:
    """A thread inside the plugin's hook (returns once it is in)."""
    plugin.entered.clear()
    plugin.release.clear()
    call = host.bound("accelopt_iteration_start")
    thread = threading.Thread(target=call, args=(IterationContext(JOB, "l", 0, 0.0),),
                              name="lane-test")
    thread.start()
    assert plugin.entered.wait(30)
    return thread


def test_a_hook_call_running_past_the_limit_is_named_once_and_let_go_when_it_ends():
    plugin = Blocks()
    host = PluginHost([(PluginSpec(name="blocks", factory=lambda c: plugin), plugin)])
    now = [0.0]
    said: list[str] = []
    dog = HookWatchdog(host.hook_code, after_s=5.0, say=said.append, clock=lambda: now[0])
    thread = _blocked_call(host, plugin)
    try:
        dog.look()
        now[0] = 4.9
        dog.look()
        assert said == []  # under the limit
        now[0] = 5.0
        dog.look()
        now[0] = 30.0
        dog.look()
    finally:
        plugin.release.set()
        thread.join(30)
    assert len(said) == 1  # once per call
    assert said[0].startswith("plugin 'blocks' has been in accelopt_iteration_start for 5.0 s "
                              "(thread lane-test, ")
    dog.look()
    assert dog._watched == {}  # the ended call's frame is not kept
    # a new call of the same hook is a new call: its time starts when it is first seen
    thread = _blocked_call(host, plugin)
    try:
        now[0] = 31.0
        dog.look()
        now[0] = 35.9
        dog.look()
        assert len(said) == 1
        now[0] = 36.0
        dog.look()
        assert len(said) == 2
    finally:
        plugin.release.set()
        thread.join(30)


def test_off_at_zero_and_a_limit_must_be_positive():
    assert not isinstance(watching(dict, 0), HookWatchdog)
    assert watching(dict, 1, "rank 1 (worker): ").where == "rank 1 (worker): "
    with pytest.raises(ValueError, match="after_s must be > 0"):
        HookWatchdog(dict, after_s=-1)


def test_a_run_whose_hook_blocks_says_so_while_it_runs(run_tiny, caplog):
    """Through ``accelopt run``'s path: the plugin's hook waits until the warning was logged
    (by the watchdog's own thread, while the run is stuck in the hook), then lets the run go
    on; the run ends normally."""
    logged = threading.Event()

    class Flag(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "has been in accelopt_iteration_end" in record.getMessage():
                logged.set()

    class WaitsForTheWarning:
        def __init__(self) -> None:
            self.waited: list[bool] = []

        @hookimpl
        def accelopt_iteration_end(self, context, result):
            if not self.waited:
                self.waited.append(logged.wait(60))

    plugin = WaitsForTheWarning()
    flag = Flag()
    logging.getLogger("accelopt.watchdog").addHandler(flag)
    try:
        record = run_tiny(PluginSpec(name="waits", factory=lambda c: plugin),
                          overrides=["cluster.mode=none", "run.hook_watchdog_s=0.2"])
    finally:
        logging.getLogger("accelopt.watchdog").removeHandler(flag)
    assert plugin.waited == [True]
    assert all(j.status == "done" for j in record.jobs)


def test_a_failing_rank_is_told_which_reported_hook_call_is_still_running():
    """A rank whose peers' transfers time out because one of its hooks blocks ended with a
    timeout naming no plugin; the rank's line now gets the watchdog's in-flight call."""
    plugin = Blocks()
    host = PluginHost([(PluginSpec(name="blocks", factory=lambda c: plugin), plugin)])
    now = [0.0]
    dog = HookWatchdog(host.hook_code, after_s=2.0, say=lambda _line: None,
                       clock=lambda: now[0])
    thread = _blocked_call(host, plugin)
    try:
        dog.look()
        now[0] = 1.0
        assert dog.in_flight() == ""  # not reported yet: not named
        now[0] = 2.0
        dog.look()
        now[0] = 5.0
        assert dog.in_flight() == ("; plugin 'blocks' had been in accelopt_iteration_start "
                                   "for at least 5.0 s (hook watchdog)")
    finally:
        plugin.release.set()
        thread.join(30)
    assert dog.in_flight() == ""  # the call ended


def test_a_ranks_line_says_its_iteration_once():
    """The transport's timeouts say their iteration, and the line added it again: '... within
    5 s at iteration 0 at iteration 0 of job 'm''."""
    from accelopt.drivers.cluster.faults import raised_line

    error = "CommunicationError: parameters of layer 0 did not arrive within 5 s at iteration 0"
    assert raised_line(2, "worker", 7, error, 0, "m") == (
        "rank 2 (worker, pid 7) raised CommunicationError: parameters of layer 0 did not "
        "arrive within 5 s at iteration 0 of job 'm'; the cluster run was stopped")
    # another iteration's number: the error's (the transfer's) is the one given, once
    other = "CommunicationError: receiving at iteration 12"
    assert raised_line(2, "worker", 7, other, 1) == (
        "rank 2 (worker, pid 7) raised CommunicationError: receiving at iteration 12; the "
        "cluster run was stopped")
