"""The cluster driver's decisions, without processes: a run of one job is broadcast once,
marked free-running, and a follower then runs the job's remaining iterations by itself; with
several jobs every iteration is broadcast and a follower runs exactly the one it is told."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from accelopt.drivers.cluster.driver import ClusterDriver

pytestmark = pytest.mark.timeout(30)


class _Part:
    """Stands in for a RankJob: counts the iterations this rank ran."""

    def __init__(self, job_id: str, iterations: int) -> None:
        self.job = SimpleNamespace(info=SimpleNamespace(job_id=job_id), iteration=0,
                                   iterations=iterations, done=False)
        self.steps = 0

    carried_service_s = 0.0

    def queueing_s(self) -> float | None:  # what the leader records of a job it leaves
        return 0.0 if self.steps else None

    def service_s(self) -> float:
        return float(self.steps)

    def step(self, lane, progress):
        self.steps += 1
        self.job.iteration += 1
        self.job.done = self.job.iteration >= self.job.iterations


def _driver(parts: list[_Part]) -> ClusterDriver:
    return ClusterDriver(cfg=None, jobs=parts, plugins=None, rank=0,  # type: ignore[arg-type]
                         device=torch.device("cpu"), progress=None, clock=lambda: 0.0)


def test_one_job_is_broadcast_once_and_marked_free_running():
    part = _Part("a", 5)
    driver = _driver([part])
    sent: list[dict] = []
    driver._send = sent.append  # type: ignore[method-assign]
    events = SimpleNamespace(lane="l")
    for _ in range(5):
        driver._lead_step(part.job, events)
    assert sent == [{"run": "a", "lane": "l", "free": True}]
    assert part.steps == 5 and len(driver.schedule) == 5


def test_several_jobs_are_broadcast_every_iteration():
    a, b = _Part("a", 2), _Part("b", 2)
    driver = _driver([a, b])
    sent: list[dict] = []
    driver._send = sent.append  # type: ignore[method-assign]
    events = SimpleNamespace(lane="l")
    for job in (a.job, b.job, a.job, b.job):
        driver._lead_step(job, events)
    assert [d["run"] for d in sent] == ["a", "b", "a", "b"]
    assert not any(d["free"] for d in sent)


def test_a_follower_runs_a_free_job_to_its_end_and_a_told_one_once():
    free = _Part("a", 4)
    driver = _driver([free])
    decisions = iter([{"run": "a", "lane": "l", "free": True}, {"stop": True}])
    driver._receive = lambda: next(decisions)  # type: ignore[method-assign]
    driver._follow()
    assert free.steps == 4
    a, b = _Part("a", 3), _Part("b", 3)
    driver = _driver([a, b])
    decisions = iter([{"run": "a", "lane": "l", "free": False},
                      {"run": "b", "lane": "l", "free": False}, {"stop": True}])
    driver._receive = lambda: next(decisions)  # type: ignore[method-assign]
    driver._follow()
    assert (a.steps, b.steps) == (1, 1)
