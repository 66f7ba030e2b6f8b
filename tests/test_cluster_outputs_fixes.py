"""What a cluster run's outputs say about it: the parameters it holds counted once each, the
mode's figures in the summary of a run of several jobs, and a run stopped by SIGTERM to its
whole process group (its ranks died with it, leaving no timeline) giving the samples/s of
the iterations its service time covers.

No processes: outcomes are built from hand-made rank results, and the leader's records are
those a driver with no process group writes.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from accelopt.config import ClusterConfig
from accelopt.drivers.cluster.faults import Progress, read_ended
from accelopt.drivers.cluster.outcome import build_outcome
from accelopt.drivers.cluster.rank import JobPart, RankResult
from accelopt.drivers.cluster.settings import settings_from
from accelopt.drivers.cluster.transport import TransportStats
from accelopt.records import JobResult
from accelopt.types import JobInfo

pytestmark = pytest.mark.timeout(30)


def _info(job_id: str, iterations: int = 2) -> JobInfo:
    return JobInfo(job_id=job_id, name=job_id[3:], model="mlp", kind="train", arrival_s=0.0,
                   iterations=iterations, batch_size=4)


def _outcome(mode: str, infos: list[JobInfo], params: dict[str, torch.Tensor] | None = None,
             handed: int = 0):
    """A two-rank run (ps: rank 0 a server, rank 1 the worker; all-reduce: two workers) of
    ``infos``, each job's two iterations 0.25 s long; ``params``: the state rank 0 hands
    over; ``handed``: the bytes each rank handed the collective per iteration."""
    cluster = OmegaConf.structured(ClusterConfig)
    cluster.mode, cluster.workers = mode, (1 if mode == "ps" else 2)
    roles = ("server", "worker") if mode == "ps" else ("worker", "worker")
    ranks = []
    for rank, role in enumerate(roles):
        parts = {}
        for k, info in enumerate(infos):
            own = [{"iteration": i, "start_s": k + 0.25 * i, "end_s": k + 0.25 * (i + 1),
                    "loss": 1.0, "samples": 4} for i in range(2)] if role == "worker" else []
            stats = TransportStats()
            stats.collective_bytes_by_iteration = {0: handed, 1: handed} if handed else {}
            parts[info.job_id] = JobPart(rank=rank, role=role, job=info, iterations=own,
                                         stats=stats,
                                         params=dict(params or {}) if rank == 0 else {})
        ranks.append(RankResult(rank=rank, role=role, pid=rank, parts=parts,
                                train_t0=0.0 if rank == 0 else None,
                                statuses={i.job_id: ("done", "") for i in infos}
                                if rank == 0 else {}))
    ranks = pickle.loads(pickle.dumps(ranks))  # as the launcher gets them: one pickle a rank
    return build_outcome(ranks, settings_from(cluster))


def test_a_tied_weight_is_counted_once_in_param_bytes_in_ps_mode():
    """A parameter server's state names an embedding tied to the output layer under both
    names (so the gathered state loads back): ``param_bytes`` was 10320 in ps mode and 6224
    in all-reduce for the same model. Each storage counts once, as the wire sends it."""
    emb, mid = torch.zeros(50, 16), torch.zeros(16, 16)
    tied = {"emb.weight": emb, "mid.weight": mid, "out.weight": emb}
    want = (emb.numel() + mid.numel()) * 4
    assert _outcome("ps", [_info("00-t")], tied).metrics["param_bytes"] == want
    assert _outcome("ps", [_info("00-t")], tied).metrics["expected_bytes_per_iteration"] == (
        2 * want)
    untied = {**tied, "out.weight": emb.clone()}
    assert _outcome("ps", [_info("00-t")], untied).metrics["param_bytes"] == want + emb.numel() * 4


def test_a_ps_run_of_several_jobs_has_the_expected_bytes_in_its_summary():
    """docs/distributed.md: the mode adds ``expected_bytes_per_iteration`` to the summary of
    every ps run, one job or several; a run of several had neither it nor a job's own. The
    run's is the median over the jobs, as ``bytes_per_iteration``'s."""
    small = {"w": torch.zeros(10)}
    metrics = _outcome("ps", [_info("00-a")], small).metrics
    assert metrics["expected_bytes_per_iteration"] == 80
    two = _outcome("ps", [_info("00-a"), _info("01-b")], small).metrics
    assert "expected_bytes_per_iteration" in two
    assert two["job.a.expected_bytes_per_iteration"] == 80
    assert two["job.b.expected_bytes_per_iteration"] == 80
    assert two["expected_bytes_per_iteration"] == 80


def test_an_allreduce_run_of_several_jobs_has_the_collective_bytes_in_its_summary():
    """All-reduce: ``collective_bytes_per_iteration`` was only ``job.<name>.<key>`` in a run
    of several jobs, not the run's own, which the summary of every all-reduce run has."""
    two = _outcome("allreduce", [_info("00-a"), _info("01-b")], handed=100).metrics
    assert two["job.a.collective_bytes_per_iteration"] == 200
    assert two["collective_bytes_per_iteration"] == 200
    assert "expected_bytes_per_iteration" not in two


def _leader(tmp_path, iterations: int):
    """A leader's driver running one job of ``iterations`` iterations, with no process
    group: a parameter server's, each of its iterations its 0.4 s part of a second (the
    workers' forward and backward come before it)."""
    from accelopt.drivers.cluster.driver import ClusterDriver

    info = _info("00-a", iterations)
    records: list[dict] = []
    job = SimpleNamespace(info=info, iteration=0)

    def step(lane, progress):
        progress.set(job.iteration, info.job_id, info.name)
        records.append({"iteration": job.iteration, "start_s": job.iteration + 0.6,
                        "end_s": job.iteration + 1.0})
        job.iteration += 1

    part = SimpleNamespace(
        job=job, step=step, iterations=records, carried_s=0.0, carried_service_s=0.0,
        service_s=lambda: sum(r["end_s"] - r["start_s"] for r in records),
        queueing_s=lambda: records[0]["start_s"] if records else None)
    progress = Progress(tmp_path, 0)
    driver = ClusterDriver(OmegaConf.create({}), [part], None, rank=0, device=None,
                           progress=progress, clock=lambda: 0.0)
    driver.train_t0 = 0.0
    driver._send = lambda decision: None  # no process group: nobody to tell
    return driver, part


def test_a_run_whose_ranks_died_with_it_gives_the_service_time_of_its_iterations(tmp_path):
    """SIGTERM to the whole process group (``timeout``, a CI runner) kills the ranks with the
    launcher, so no worker leaves its records: the job's iterations came from the leader's
    progress (112) and its service time from the leader's record, written at its first
    iteration only (one iteration's), and the job read 67946 samples/s for a real 2300. The
    leader's service time so far follows its iterations, and counts the whole time between
    them (a server's own part of each is shorter than the workers'): the job's samples/s is
    the one they ran at (4 samples a second here), but for the part of the first iteration
    before the leader's own."""
    from accelopt.runtime.run import _ended_before

    driver, part = _leader(tmp_path, iterations=100)
    events = SimpleNamespace(lane="default")
    for _ in range(40):
        driver._lead_step(part.job, events)
    ended = read_ended(tmp_path)
    assert ended["00-a"]["iterations"] == 40
    assert ended["00-a"]["service_s"] == pytest.approx(0.4 + 39 * 1.0)
    got = _ended_before(JobResult(part.job.info), ended,
                        reached=Progress.read(tmp_path, 0), completed=None, service=None)
    assert got.iterations_done == 40
    assert got.samples / got.service_s == pytest.approx(160 / 39.4)
    assert got.samples / got.service_s == pytest.approx(4.0, rel=1 / 39)


_SIGTERMED = """
import importlib.util, os, signal, sys, threading

# the module alone, not its package (which imports torch: seconds a process)
spec = importlib.util.spec_from_file_location("faults", sys.argv[3])
faults = sys.modules["faults"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(faults)

left = threading.Event()

def leave() -> None:  # the rank's writer: its timeline so far, once the launcher asks
    sys.stdin.readline()
    with open(sys.argv[1], "w") as fh:
        fh.write("timeline so far")
    left.set()

threading.Thread(target=leave, daemon=True).start()
faults.sigterm_after(left, wait_s=float(sys.argv[2]))
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
sys.exit(7)  # not reached: the rank ends as SIGTERM ends it
"""


def _sigtermed(tmp_path, wait_s: float) -> tuple[int, bool]:
    """A rank-like process that SIGTERMs itself after :func:`sigterm_after`; the launcher's
    request to leave its timeline comes once it said it is ready. Its exit status, and
    whether it left the timeline."""
    import subprocess
    import sys

    from accelopt.drivers.cluster import faults

    left = tmp_path / "so-far"
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERMED, str(left), str(wait_s),
                             faults.__file__],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    if wait_s:
        proc.stdin.write("leave\n")
        proc.stdin.flush()
    proc.wait(timeout=20)
    return proc.returncode, left.exists()


def test_a_rank_stopped_with_its_launcher_leaves_its_timeline_before_it_dies(tmp_path):
    """SIGTERM to the whole process group reached the ranks with the launcher: they died at
    once, and the stopped run's trace.json was empty, its losses gone. A rank's SIGTERM
    waits for its timeline so far to be written (the launcher asks for it as the run
    stops), then ends the rank as SIGTERM does; a rank signalled alone dies of it too."""
    import signal

    assert _sigtermed(tmp_path, wait_s=30.0) == (-signal.SIGTERM, True)
    (tmp_path / "so-far").unlink()
    assert _sigtermed(tmp_path, wait_s=0.0) == (-signal.SIGTERM, False)
