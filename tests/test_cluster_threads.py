"""``accelopt.drivers.cluster.threads``: short-lived work on reused threads, never queued."""

from __future__ import annotations

import os
import threading

import pytest

from accelopt.drivers.cluster import threads

pytestmark = pytest.mark.timeout(30)


def test_work_runs_and_a_finished_thread_takes_the_next_work():
    ran: list[tuple[int, str]] = []

    def work(tag: str) -> None:
        ran.append((threading.get_ident(), threading.current_thread().name + tag))

    first = threads.start(work, "!", name="first")
    assert first.join(10) and not first.is_alive()
    second = threads.start(work, "?", name="second")
    assert second.join(10)
    (one, name_one), (two, name_two) = ran
    assert one == two  # the same thread, reused
    assert (name_one, name_two) == ("first!", "second?")


def test_work_is_never_queued_behind_blocked_work():
    """Two pieces of work that wait for each other both finish: the second gets a thread of
    its own while the first blocks."""
    a_started, b_done = threading.Event(), threading.Event()

    def a() -> None:
        a_started.set()
        assert b_done.wait(10)

    task_a = threads.start(a)
    assert a_started.wait(10)
    task_b = threads.start(b_done.set)
    assert task_b.join(10) and task_a.join(10)


def test_an_escaping_exception_is_reported_and_the_work_counts_as_done(monkeypatch):
    seen: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))

    def fails() -> None:
        raise RuntimeError("boom")

    assert threads.start(fails).join(10)
    assert [str(e) for e in seen] == ["boom"]
    assert threads.start(lambda: None).join(10)  # the thread serves on


def test_an_idle_thread_ends(monkeypatch):
    monkeypatch.setattr(threads, "_IDLE_S", 0.01)
    holder: list[threading.Thread] = []
    threads.start(lambda: holder.append(threading.current_thread())).join(10)
    holder[0].join(10)
    assert not holder[0].is_alive()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_has_no_idle_threads_of_its_parent():
    threads.start(lambda: None).join(10)
    pid = os.fork()
    if pid == 0:  # the child: its parent's idle threads do not exist here
        os._exit(0 if not threads._idle else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
