"""The cross-iteration training simulator (plugins/tictac/crossiter.py): bounds it must
respect, and the schedules it must tell apart."""

from __future__ import annotations

import numpy as np
import pytest
from accelopt_plugins.tictac.crossiter import (
    DEFAULT,
    Link,
    Schedule,
    Workload,
    resimulate,
    saved,
    simulate,
)
from accelopt_plugins.tictac.dag import Dag, training_dag

pytestmark = pytest.mark.timeout(30)

EARLY = Schedule(early_update=True)
PRIORITY = Schedule(early_update=True, by_priority=True)


def chain(layers: int, nbytes: list[int] | None = None) -> Dag:
    """A chain of linear layers, one weight each (first layer first)."""
    sizes = nbytes or [1000] * layers
    recvs = {f"w{k}": sizes[k] for k in range(layers)}
    ops = [(f"l{k}", [f"w{k}"] + ([f"l{k - 1}"] if k else [])) for k in range(layers)]
    return training_dag(Dag.from_spec(recvs, ops))


def workload(dag: Dag, compute_s: float = 1.0, order=None) -> Workload:
    times = np.zeros(dag.n)
    for op in dag.program:
        times[op] = compute_s
    return Workload.from_dag(dag, times, order if order is not None else range(len(dag.recvs)))


def test_the_workload_knows_when_each_gradient_is_complete():
    w = workload(chain(3))
    assert w.reads == [[0], [1], [2]]
    # backward runs l2, l1, l0: w2's gradient after the first backward op, w0's after the last
    assert w.grad_after == [2, 1, 0]
    assert len(w.forward_s) == len(w.backward_s) == 3


def test_no_schedule_beats_the_link_or_the_compute():
    w = workload(chain(4))
    for link in (Link(bytes_per_s=1000.0, workers=2), Link(bytes_per_s=1000.0, shared=False)):
        for schedule in (DEFAULT, EARLY, PRIORITY, Schedule(True, True, 300)):
            got = simulate(w, link, schedule)
            assert got.iteration_s >= 8.0 - 1e-9  # forward + backward: 8 ops of 1 s
            assert got.iteration_s >= got.link_busy_s - 1e-9


def test_default_iteration_is_compute_plus_the_round_trip_it_cannot_overlap():
    """Shared bus, one worker, 1 s per op and per transfer, no update time: the default
    pulls every tensor after the last gradient, so the first layer waits for the whole
    pull... exactly computed here."""
    w = workload(chain(2))
    link = Link(bytes_per_s=1000.0, update_bytes_per_s=float("inf"))
    got = simulate(w, link, DEFAULT, iterations=6)
    # fwd0 fwd1 bwd1 (w1 grad up 1 s, overlaps bwd0) bwd0 (w0 grad up 1 s) | step | w0 down, w1 down
    # forward of the next iteration starts once w0 is in: 4 s compute + 1 s (w0 grad) + 1 s (w0)
    assert got.iteration_s == pytest.approx(6.0)


def test_the_early_update_overlaps_the_next_pull_with_the_last_gradients():
    """On the server's full-duplex link the parameters go down while the last gradients go
    up: 2 workers, 1 s per op and per tensor, the iteration 18 -> 15 s, 14 s by priority."""
    w = workload(chain(4))
    link = Link(bytes_per_s=1000.0, update_bytes_per_s=float("inf"), shared=False, workers=2)
    assert simulate(w, link, DEFAULT).iteration_s == pytest.approx(18.0)
    assert simulate(w, link, EARLY).iteration_s == pytest.approx(15.0)
    assert simulate(w, link, PRIORITY).iteration_s == pytest.approx(14.0)


def test_on_one_bus_early_parameters_queue_in_front_of_the_last_gradients():
    """What the benchmark measured on the shared loopback: the bytes per iteration are
    fixed, and first-posted-first the last layers' parameters (updated first) go ahead of
    the first layers' gradients, so the first layer's parameter comes last: slower."""
    w = workload(chain(4))
    link = Link(bytes_per_s=1000.0, update_bytes_per_s=float("inf"))
    assert simulate(w, link, DEFAULT).iteration_s == pytest.approx(10.0)
    assert simulate(w, link, EARLY).iteration_s == pytest.approx(13.0)


def test_partitioning_lets_the_first_layer_through_a_large_tensor():
    """A huge last-layer parameter posted before the small first-layer one: whole, the
    first layer waits behind it; in chunks, it goes after one chunk."""
    dag = chain(2, nbytes=[100, 10_000])
    w = workload(dag, compute_s=0.1)
    link = Link(bytes_per_s=1000.0, update_bytes_per_s=float("inf"), shared=False)
    whole = simulate(w, link, PRIORITY).iteration_s
    chunked = simulate(w, link, Schedule(True, True, partition_bytes=500)).iteration_s
    assert chunked < whole


def test_workers_multiply_the_servers_link():
    w = workload(chain(3), compute_s=0.0)
    one = simulate(w, Link(bytes_per_s=1000.0, workers=1), DEFAULT).iteration_s
    two = simulate(w, Link(bytes_per_s=1000.0, workers=2), DEFAULT).iteration_s
    assert two == pytest.approx(2 * one)


def test_it_refuses_too_few_iterations():
    with pytest.raises(ValueError, match="iterations >= warmup"):
        simulate(workload(chain(1)), Link(1000.0), iterations=3, warmup=2)


def test_a_saved_prediction_simulates_again_with_a_measured_compute():
    """The plugin saves the simulator's inputs with its plan; the benchmark simulates them
    again with the compute a run measured (every op scaled alike)."""
    import json

    w = workload(chain(3))
    link = Link(bytes_per_s=1000.0, workers=2, update_bytes_per_s=1e6)
    data = json.loads(json.dumps(saved(w, link, {"off": DEFAULT, "early": EARLY})))
    assert resimulate(data, "off").iteration_s == simulate(w, link, DEFAULT).iteration_s
    doubled = w.with_compute(2 * w.compute_s)
    assert doubled.forward_s == [2.0] * 3 and doubled.compute_s == 12.0
    assert resimulate(data, "early", compute_s=12.0).iteration_s == pytest.approx(
        simulate(doubled, link, EARLY).iteration_s)


def test_inputs_it_cannot_simulate_are_refused_in_one_line():
    """The plugin turns these into a warning and no prediction; the run goes on."""
    empty = Workload([], [], [], [], [], [])
    with pytest.raises(ValueError, match="no compute ops"):
        simulate(empty, Link(1000.0))
    wrong = workload(chain(2))
    wrong.reads[1] = [5]  # a parameter the workload does not have
    with pytest.raises(ValueError, match="an op reads parameter 5, the workload has 2"):
        simulate(wrong, Link(1000.0))
    wrong = workload(chain(2))
    wrong.grad_after[0] = 7
    with pytest.raises(ValueError, match="backward op that does not exist"):
        simulate(wrong, Link(1000.0))


def test_predict_gives_the_default_and_every_candidate():
    from accelopt_plugins.tictac.crossiter import predict
    from accelopt_plugins.tictac.tuning import Window

    w = workload(chain(3))
    link = Link(bytes_per_s=1000.0, workers=2, shared=False)
    seconds, data = predict(w, link, (None, Window(0), Window(100, 300)))
    assert set(seconds) == {None, Window(0), Window(100, 300)}
    assert set(data["schedules"]) == {"off", "credit_0", "credit_100_part_300"}
    assert data["schedules"]["credit_0"] == {"early_update": True, "by_priority": False,
                                             "partition_bytes": 0}
    assert seconds[None] == simulate(w, link, DEFAULT).iteration_s


def test_the_servers_cost_per_tensor_lengthens_the_default_step_by_each_tensor():
    """The default step updates every tensor once, after the last gradient: ``tensor_s``
    adds n x tensor_s to the round trip the iteration cannot overlap (6 s above)."""
    w = workload(chain(2))
    link = Link(bytes_per_s=1000.0, update_bytes_per_s=float("inf"), tensor_s=0.5)
    assert simulate(w, link, DEFAULT, iterations=6).iteration_s == pytest.approx(7.0)


def test_forward_and_backward_scale_apart():
    w = workload(chain(3))  # 3 s forward, 3 s backward
    split = w.with_phases(forward_s=1.5, backward_s=6.0)
    assert split.forward_s == [0.5] * 3 and split.backward_s == [2.0] * 3
    assert split.reads == w.reads and split.nbytes == w.nbytes


def test_a_saved_prediction_simulates_again_with_what_a_run_measured():
    """The measured calibration: forward and backward apart, the per-transfer cost, and
    the server's turnaround less its update time spread over its tensors."""
    import json

    from accelopt_plugins.tictac.measured import Measured

    w = workload(chain(2))
    link = Link(bytes_per_s=1000.0, workers=2, update_bytes_per_s=2000.0)
    data = json.loads(json.dumps(saved(w, link, {"off": DEFAULT, "early": EARLY})))
    facts = Measured(forward_s=1.0, backward_s=4.0, message_s=0.1, server_s=1.5,
                     iterations=5)
    by_hand = Link(bytes_per_s=1000.0, workers=2, update_bytes_per_s=2000.0, message_s=0.1,
                   tensor_s=(1.5 - 2000 / 2000.0) / 2)
    for name, schedule in (("off", DEFAULT), ("early", EARLY)):
        assert resimulate(data, name, measured=facts).iteration_s == pytest.approx(
            simulate(w.with_phases(1.0, 4.0), by_hand, schedule).iteration_s)
