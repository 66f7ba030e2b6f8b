"""tictac: DAG, properties, TIC/TAC, simulator, oracle and CLI, against hand-worked DAGs and
hypothesis properties (no processes, no timing assertions)."""

from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest
import torch
from accelopt_plugins.tictac import oracle
from accelopt_plugins.tictac.cli import parse, print_plan
from accelopt_plugins.tictac.dag import Dag, build_dag, trace, training_dag
from accelopt_plugins.tictac.order import PropertyState, compute_order, tac, tic
from accelopt_plugins.tictac.plan import plan_measured, plan_meta
from accelopt_plugins.tictac.simulate import Simulator, efficiency
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from accelopt.errors import UserError
from accelopt.workloads.models import MODEL_NAMES, build_model

pytestmark = pytest.mark.timeout(60)


def paper_dag() -> Dag:
    """Recvs A, B, C; c1 reads A, c2 reads A and B, c3 reads C (worked out by hand below)."""
    return Dag.from_spec({"A": 1, "B": 4, "C": 2},
                         [("c1", ["A"]), ("c2", ["A", "B"]), ("c3", ["C"])])


def times_of(dag: Dag, recv: dict[str, float], comp: dict[str, float]) -> np.ndarray:
    t = np.zeros(dag.n)
    for i, name in enumerate(dag.names):
        t[i] = recv.get(name, comp.get(name, 0.0))
    return t


RECV_T = {"A": 1.0, "B": 4.0, "C": 2.0}
COMP_T = {"c1": 2.0, "c2": 1.0, "c3": 5.0}


# -- properties, TIC, TAC on hand-worked DAGs ------------------------------------------------


def test_properties_by_hand():
    dag = paper_dag()
    t = times_of(dag, RECV_T, COMP_T)
    state = PropertyState(dag.dep_matrix("dataflow"), t[dag.program], t[dag.recvs])
    p = state.properties()
    # c1 alone unlocks A (P_A = 2), c3 alone unlocks C (P_C = 5); c2 needs A+B (M+ = 1+4)
    assert p.P.tolist() == [2.0, 0.0, 5.0]
    assert p.M.tolist() == [1.0, 4.0, 2.0]
    assert p.Mplus.tolist() == [5.0, 5.0, np.inf]
    state.remove(0)  # A scheduled: c2 now needs only B, so it counts toward P_B
    p = state.properties()
    assert p.P.tolist() == [0.0, 1.0, 5.0]
    assert p.Mplus.tolist() == [np.inf, np.inf, np.inf]


def test_tic_by_hand():
    order, levels = tic(paper_dag(), "dataflow")
    assert order == [0, 1, 2]  # A, B share M+ = 2 (one level, named order breaks the tie)
    assert levels == [0, 0, 1]


def test_tac_by_hand_dataflow_is_johnson():
    dag = paper_dag()
    t = times_of(dag, RECV_T, COMP_T)
    # A first (M_A=1 small), then C (M=2 < P=5: Johnson's first set), then B (M=4 > P=1)
    assert tac(dag, t, "dataflow") == [0, 2, 1]
    sim = Simulator(dag, t, "dataflow")
    assert sim.run([0, 2, 1]).makespan == pytest.approx(9.0)
    assert sim.run([0, 1, 2]).makespan == pytest.approx(12.0)  # named
    assert sim.run([0, 2, 1]).efficiency == pytest.approx(6 / 7)
    assert sim.run([0, 1, 2]).efficiency == pytest.approx(3 / 7)


def test_tac_eager_follows_program_order():
    dag = paper_dag()
    t = times_of(dag, RECV_T, COMP_T)
    # eager: c3 runs after c2, so B is needed before C; TAC sees that through the chain
    assert tac(dag, t, "eager") == [0, 1, 2]
    sim = Simulator(dag, t, "eager")
    # A,B,C: c1 1-3, c2 5-6, c3 7-12; A,C,B: c1 1-3, c2 7-8 (B lands at 7), c3 8-13
    assert sim.run([0, 1, 2]).makespan == pytest.approx(12.0)
    assert sim.run([0, 2, 1]).makespan == pytest.approx(13.0)


def test_eager_makespan_hand_computed():
    dag = paper_dag()
    t = times_of(dag, RECV_T, COMP_T)
    sim = Simulator(dag, t, "eager")
    # order A,B,C: A 0-1, B 1-5, C 5-7; c1 1-3, c2 5-6, c3 7-12
    r = sim.run([0, 1, 2])
    assert r.op_start == {3: 1.0, 4: 5.0, 5: 7.0}
    assert r.makespan == pytest.approx(12.0)


def test_baselines():
    dag = paper_dag()
    assert compute_order(dag, "named") == [0, 1, 2]
    assert compute_order(dag, "reverse") == [2, 1, 0]
    import random
    a = compute_order(dag, "random", rng=random.Random("0-1-1"))
    b = compute_order(dag, "random", rng=random.Random("0-1-1"))
    assert a == b and sorted(a) == [0, 1, 2]


# -- hypothesis properties -------------------------------------------------------------------


@st.composite
def random_dags(draw):
    nr = draw(st.integers(1, 7))
    nc = draw(st.integers(1, 9))
    recvs = {f"r{i}": draw(st.integers(1, 1000)) for i in range(nr)}
    ops: list[tuple[str, list[str]]] = []
    for k in range(nc):
        pool = list(recvs) + [name for name, _ in ops]
        ins = draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))
        ops.append((f"c{k}", ins))
    dag = Dag.from_spec(recvs, ops)
    t = np.array([draw(st.floats(0.01, 10.0)) for _ in range(dag.n)])
    return dag, t


@settings(max_examples=60, deadline=None)
@given(random_dags(), st.sampled_from(["eager", "dataflow"]))
def test_orders_are_permutations_and_makespan_within_bounds(case, execution):
    dag, t = case
    nr = len(dag.recvs)
    order_tac = tac(dag, t, execution)
    order_tic, levels = tic(dag, execution)
    assert sorted(order_tac) == list(range(nr))
    assert sorted(order_tic) == list(range(nr))
    assert levels == sorted(levels)
    sim = Simulator(dag, t, execution)
    for order in (order_tac, order_tic, list(range(nr))):
        r = sim.run(order)
        assert max(sim.mc, sim.pc) - 1e-9 <= r.makespan <= sim.mc + sim.pc + 1e-9
    if execution == "eager":  # the vectorised eager path equals the event-by-event one
        orders = np.array([order_tac, order_tic, list(range(nr))])
        np.testing.assert_allclose(sim.makespans(orders),
                                   [sim.run(o).makespan for o in orders])


@settings(max_examples=40, deadline=None)
@given(random_dags())
def test_dep_sets_are_transitive_recv_sets(case):
    dag, _ = case
    bits = dag.dep_bits("dataflow")

    def reach(op):
        if dag.kinds[op] == "recv":
            return {op}
        return set().union(*[reach(i) for i in dag.inputs[op]]) if dag.inputs[op] else set()

    for op in range(dag.n):
        expect = {dag.recvs.index(r) for r in reach(op)}
        assert {r for r in range(len(dag.recvs)) if bits[op] >> r & 1} == expect


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20)), min_size=1, max_size=5))
def test_tac_is_johnson_optimal_on_two_machine_flow_shops(jobs):
    """n independent (recv -> compute) pairs are Johnson's two-machine flow shop: TAC's order
    must reach the optimal makespan (brute force over every permutation)."""
    recvs = {f"r{i}": 1 for i in range(len(jobs))}
    dag = Dag.from_spec(recvs, [(f"c{i}", [f"r{i}"]) for i in range(len(jobs))])
    t = np.array([float(a) for a, _ in jobs] + [float(b) for _, b in jobs])
    sim = Simulator(dag, t, "dataflow")
    best = min(sim.run(list(p)).makespan for p in itertools.permutations(range(len(jobs))))
    assert sim.run(tac(dag, t, "dataflow")).makespan == pytest.approx(best)


def test_efficiency_formula():
    assert efficiency(2.0, 3.0, 3.0) == pytest.approx(1.0)
    assert efficiency(2.0, 3.0, 5.0) == pytest.approx(0.0)
    assert efficiency(2.0, 3.0, 4.0) == pytest.approx(0.5)


# -- tracing ---------------------------------------------------------------------------------


SHAPES = {"vector": (1, 8, 8), "image": (3, 16, 16), "sequence": (12,)}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_zoo_traces_with_one_recv_per_parameter(name):
    from accelopt.workloads.models import model_input_kind

    model = build_model(name, input_shape=SHAPES[model_input_kind(name)], num_classes=10,
                        vocab_size=50, width=8)
    dag = build_dag(model, name)
    params = dict(model.named_parameters())
    assert dag.recv_names == list(params)
    assert [dag.nbytes[r] for r in dag.recvs] == [p.numel() * 4 for p in params.values()]
    read = {i for op in dag.program for i in dag.inputs[op] if dag.kinds[i] == "recv"}
    assert read == set(dag.recvs)  # every parameter is read by some op
    train = training_dag(dag)
    assert len(train.program) == 2 * len(dag.program)


def test_inception_branches_are_parallel_in_the_dag():
    model = build_model("inception", input_shape=(3, 16, 16), num_classes=10, width=8)
    dag = build_dag(model, "inception")
    bits = dag.dep_bits("dataflow")
    idx = {n: i for i, n in enumerate(dag.names)}
    a = [n for n in dag.names if n.startswith("block1_branch1x1")][-1]
    b = [n for n in dag.names if n.startswith("block1_branch5x5")][-1]
    # neither branch needs the other's parameters
    assert bits[idx[a]] & bits[idx[b]] == bits[idx["stem_0"]] | bits[idx["stem_1"]]
    eager = dag.dep_bits("eager")
    assert eager[idx[b]] & bits[idx[a]] == bits[idx[a]]  # eager: program order chains them


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _DataDependent()

    def forward(self, x):
        return self.inner(x)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return x


def test_untraceable_model_is_one_line_naming_the_module():
    with pytest.raises(UserError) as err:
        trace(_Branchy(), "branchy")
    msg = str(err.value)
    assert "\n" not in msg and "'inner'" in msg and "_DataDependent" in msg


# -- meta models and schedule times ------------------------------------------------------------


def test_meta_models_have_the_papers_sizes():
    from accelopt_plugins.tictac.meta_models import build_meta

    expect = {"resnet50": 25.56e6, "resnet152": 60.19e6, "inception_v3": 23.83e6,
              "vgg16": 138.36e6, "alexnet": 61.10e6}
    for name, n in expect.items():
        model, _ = build_meta(name)
        total = sum(p.numel() for p in model.parameters())
        assert total == pytest.approx(n, rel=0.01), name
        assert all(p.device.type == "meta" for p in model.parameters())


def test_resnet152_plan_orders_and_tac_is_permutation():
    plan = plan_meta("resnet152", batch=32, kind="infer", a=1.0, execution="dataflow")
    assert plan.ratio_a == pytest.approx(1.0)
    plan.add("tac")
    plan.add("tic")
    assert sorted(plan.orders["tac"]) == list(range(467))
    # a generous ratio, not a timing: TIC must be far cheaper than TAC
    assert plan.schedule_s["tic"] < plan.schedule_s["tac"]


# -- oracle ---------------------------------------------------------------------------------


def test_oracle_is_min_and_cached_and_stale_cache_rebuilt(tmp_path):
    torch.manual_seed(0)
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, width=16)
    x = torch.randn(4, 1, 8, 8)
    p1 = plan_measured(model, x, name="mlp", kind="train", bytes_per_s=1e6, runs=3,
                       run_dir=tmp_path)
    assert p1.compute.source == "measured" and p1.compute.backward_s > 0
    assert all(v > 0 for v in p1.compute.forward.values())
    p2 = plan_measured(model, x, name="mlp", kind="train", bytes_per_s=1e6, runs=3,
                       run_dir=tmp_path)
    assert p2.cache.endswith("(cached)") and p2.compute.forward == p1.compute.forward
    other = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, width=24)
    with pytest.warns(RuntimeWarning, match="stale"):
        p3 = plan_measured(other, x, name="mlp", kind="train", bytes_per_s=1e6, runs=2,
                           run_dir=tmp_path)
    assert not p3.cache.endswith("(cached)")
    # transfer time is bytes / bandwidth (+ the per-message cost)
    r0 = p3.dag.recvs[0]
    assert p3.times[r0] == pytest.approx(p3.dag.nbytes[r0] / 1e6)


def test_a_model_computing_its_own_loss_is_planned_not_a_failed_run():
    """``forward(x, labels=None)`` with a loss branch: fx traced ``labels`` as a placeholder,
    baked the branch in, and the oracle's run without labels raised TypeError out of the
    job-built hook, stopping the whole PS run; a dataclass output (``.loss``/``.logits``)
    could not be timed either. Now ``labels`` is held at its default while tracing, an
    output object's logits are used, and a graph that still does not run is a UserError
    (the plugin's "not applied" row), never another exception."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from byo_models import own_loss, own_loss_dict

    torch.manual_seed(0)
    x = torch.randn(4, 1, 8, 8)
    for factory in (own_loss_dict, own_loss):
        plan = plan_measured(factory(input_shape=(1, 8, 8), num_classes=10), x,
                             name=factory.__name__, kind="train", bytes_per_s=1e6, runs=2)
        assert plan.compute.backward_s > 0 and plan.dag.recvs, factory.__name__

    from accelopt.errors import UserError

    def mismatched(out: torch.Tensor) -> torch.Tensor:  # the job's loss failing on the graph
        raise RuntimeError("shapes [4, 10] and [4] do not match")

    with pytest.raises(UserError, match="does not run on the job's inputs to be timed: "
                                        "RuntimeError: shapes"):
        plan_measured(own_loss_dict(input_shape=(1, 8, 8), num_classes=10), x, name="odd",
                      kind="train", bytes_per_s=1e6, runs=2, loss=mismatched)


def test_fit_link_recovers_overhead_and_bandwidth():
    samples, t = [], 0.0
    for k in range(12):
        nbytes = 1000 * (1 + k % 4)
        start = t
        t += 0.003 + nbytes / 1e6
        samples.append((start, t, nbytes))
    alpha, bw = oracle.fit_link(samples)
    assert alpha == pytest.approx(0.003, rel=1e-6)
    assert bw == pytest.approx(1e6, rel=1e-6)
    alpha, bw = oracle.fit_link(samples, bytes_per_s=1e6)  # shaped: only alpha is fitted
    assert alpha == pytest.approx(0.003, rel=1e-6) and bw == 1e6


# -- CLI -------------------------------------------------------------------------------------


def test_cli_parse_and_print(capsys):
    config, meta, overrides = parse(["model=alexnet", "plugins.tictac.heuristic=tic",
                                     "tictac.execution=dataflow", "a=2"])
    assert config.heuristic == "tic" and config.execution == "dataflow"
    assert meta == {"model": "alexnet", "a": "2"} and overrides == []
    with pytest.raises(UserError, match="unknown key"):
        parse(["plugins.tictac.heuristc=tac"])
    plan = plan_meta("alexnet", batch=8, kind="infer", a=1.0)
    import io
    buf = io.StringIO()
    print_plan(plan, "tac", buf)
    text = buf.getvalue()
    assert "features.0.weight" in text and "predicted makespan" in text
    assert "random:" in text and "p95" in text


def test_cli_command_end_to_end(capsys):
    from accelopt.cli.main import dispatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = dispatch(["tictac", "order", "workload=tiny", "plugins.tictac.heuristic=tac",
                         "plugins.tictac.oracle_runs=1"], False)
    out = capsys.readouterr().out
    assert code == 0
    assert "net.1.weight" in out and "tac:" in out


@pytest.mark.parametrize("args, words", [
    (["model=resnet50", "batch=abc"], "batch must be a whole number >= 1, got 'abc'"),
    (["model=resnet50", "batch=-4"], "batch must be a whole number >= 1"),  # torch's error
    (["model=resnet50", "a=0"], r"a \(Mc/Pc, .*\) must be a number in \["),  # 1/0
    (["model=resnet50", "a=-1"], r"must be a number in \[1e-06, 1e\+06\]"),  # E = nan, exit 0
    (["model=resnet50", "a=1e308"], r"in \[1e-06, 1e\+06\], got '1e308'"),  # inf ms, E = nan
    (["model=resnet50", "a=1e-300"], r"must be a number in \[1e-06, 1e\+06\]"),  # E = nan
    (["model=resnet50", "a=nan"], r"must be a number in \[1e-06, 1e\+06\]"),
    (["workload=tiny", "plugins.tictac.bandwidth_bytes_per_s=nan"],  # read as "measure"
     r"bandwidth_bytes_per_s=nan must be a finite number >= 0"),
    (["workload=tiny", "plugins.tictac.message_s=nan"], "message_s=nan must be >= 0 and finite"),
    (["model=alexnet", "plugins.tictac.message_s=inf"], "message_s=inf must be >= 0 and finite"),
    (["model=resnet50", "kind=bogus"], "kind must be one of infer, train"),  # inference
    (["workload=tiny", "plugins.tictac.force=maybe"], "is not a bool"),  # read as false
    (["workload=tiny", "batch=3"], "batch goes with model=NAME"),  # ignored
    (["workload=tiny", "job=tiny-cmn"], "no job 'tiny-cmn'; did you mean 'tiny-cnn'?"),
    (["model=alexnet", "plugins.tictac.heuristic=off"], "heuristic=off has no order"),
])
def test_cli_bad_arguments_are_one_line(args, words, capsys):
    """Each of these crashed with a raw error (exit 1), or printed a plan of something else
    with exit 0."""
    from accelopt.cli.main import dispatch

    with pytest.raises(UserError, match=words) as info:
        dispatch(["tictac", "order", *args], False)
    assert "\n" not in str(info.value)


def test_cli_prints_no_negative_zero_efficiency(capsys):
    """resnet50's reverse order has E = -1e-15 (a rounding error), printed as -0.000."""
    from accelopt.cli.main import dispatch

    assert dispatch(["tictac", "order", "model=resnet50"], False) == 0
    out = capsys.readouterr().out
    assert "reverse:" in out and "E = 0.000" in out
    assert "-0.000" not in out and "nan" not in out


def test_cli_priority_prints_the_order_it_ranks_by_and_names_the_job_it_planned(capsys):
    """heuristic=priority raised "unknown baseline"; a workload's first job was planned
    alone, the others dropped without a word."""
    from accelopt.cli.main import dispatch

    assert dispatch(["tictac", "order", "model=alexnet", "plugins.tictac.heuristic=priority"],
                    False) == 0
    assert "# order (priority: ranked by tac)" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert dispatch(["tictac", "order", "workload=tiny", "plugins.tictac.oracle_runs=1"],
                        False) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first == ("# the workload has 2 jobs; this is the first, tiny-mlp (pick "
                         "another with job=NAME: tiny-cnn)")
        assert dispatch(["tictac", "order", "workload=tiny", "job=tiny-cnn",
                         "plugins.tictac.oracle_runs=1"], False) == 0
    assert capsys.readouterr().out.startswith("# cnn-")


def test_cli_names_a_workload_job_without_a_width_by_its_name(capsys):
    """The header named the plan ``{model}-w{width}``: ``# mlp-wNone`` for a job that sets no
    width. It is named as a run's plan is, ``{model}-{job}``."""
    from accelopt.cli.main import dispatch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert dispatch(["tictac", "order", "workload=single",
                         "workload.jobs=[{name: m, model: mlp, batch_size: 8, iterations: 2}]",
                         "plugins.tictac.oracle_runs=1"], False) == 0
    out = capsys.readouterr().out
    assert out.startswith("# mlp-m: ") and "None" not in out


def test_plan_json_round_trip(tmp_path):
    plan = plan_meta("alexnet", batch=8, kind="infer")
    plan.add("tac")
    path = tmp_path / "order.json"
    path.write_text(json.dumps(plan.names("tac")))
    assert json.loads(path.read_text()) == plan.dag.recv_names  # sequential net: named


def test_tac_exact_ties_on_m_plus_follow_the_scan_order_not_rounding():
    """Times in multiples of 0.1: op x reads r0 (0.1 s) and r1 (0.2 s), op y reads r2 and r3
    (0.15 s each). Both rows' M+ is 0.3 s exactly, but in floating point 0.1 + 0.2 is
    0.30000000000000004 > 0.15 + 0.15; the documented tie-break (scan order: the lower recv
    index) must decide, so r0 comes first, not r2."""
    dag = Dag.from_spec({"r0": 1, "r1": 1, "r2": 1, "r3": 1},
                        [("x", ["r0", "r1"]), ("y", ["r2", "r3"])])
    times = np.array([0.1, 0.2, 0.15, 0.15, 0.1, 0.1])
    assert 0.1 + 0.2 != 0.15 + 0.15  # the rounding this test is about
    order = tac(dag, times, "dataflow")
    assert order[0] == 0, order
    assert sorted(order) == [0, 1, 2, 3]
