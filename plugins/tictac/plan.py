"""From a model to priorities: trace, time, order, and predict (the "ordering wizard").

Used by the plugin inside a server rank, by the CLI ``accelopt tictac order`` and by the
benchmarks, so all three compute exactly the same thing.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelopt_plugins.tictac import oracle
from accelopt_plugins.tictac.dag import (
    Dag,
    Execution,
    Traced,
    annotate_costs,
    build_dag,
    trace,
    trace_inputs,
    training_dag,
)
from accelopt_plugins.tictac.order import HEURISTICS, compute_order
from accelopt_plugins.tictac.simulate import Simulator, efficiency
from torch import nn

from accelopt.errors import UserError, error_text

RANDOM_SAMPLES = 1000


@dataclass
class Plan:
    """Everything decided for one (model, batch, device, link)."""

    dag: Dag
    compute: oracle.ComputeTimes
    times: np.ndarray
    execution: Execution
    bytes_per_s: float
    message_s: float = 0.0
    orders: dict[str, list[int]] = field(default_factory=dict)
    schedule_s: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)
    cache: str = ""
    traced_by: str = "torch.fx"
    """How the op graph was obtained: ``torch.fx`` or ``torch.export`` (see ``trace_inputs``)."""

    @property
    def sim(self) -> Simulator:
        return Simulator(self.dag, self.times, self.execution)

    @property
    def ratio_a(self) -> float:
        mc = float(self.times[self.dag.recvs].sum())
        pc = float(self.times[self.dag.program].sum())
        return mc / pc if pc > 0 else float("inf")

    def names(self, heuristic: str) -> list[str]:
        return [self.dag.recv_names[r] for r in self.orders[heuristic]]

    def order_for(self, heuristic: str, rng: random.Random | None = None) -> list[int]:
        if heuristic == "random":
            return compute_order(self.dag, "random", rng=rng)
        if heuristic not in self.orders:
            self.add(heuristic)
        return self.orders[heuristic]

    def add(self, heuristic: str) -> None:
        t = time.perf_counter()
        self.orders[heuristic] = compute_order(self.dag, heuristic, self.times, self.execution)
        self.schedule_s[heuristic] = time.perf_counter() - t

    def predict(self, heuristics: tuple[str, ...] = HEURISTICS, samples: int = RANDOM_SAMPLES,
                seed: int = 0) -> dict[str, dict[str, float]]:
        """Simulated makespan and E per heuristic; random: mean and p95 over ``samples``."""
        sim = self.sim
        for h in heuristics:
            if h == "random":
                rng = np.random.default_rng(seed)
                nr = len(self.dag.recvs)
                orders = np.stack([rng.permutation(nr) for _ in range(samples)]) if nr else \
                    np.zeros((samples, 0), dtype=np.int64)
                ms = sim.makespans(orders)
            else:
                if h not in self.orders:
                    self.add(h)
                ms = sim.makespans(np.asarray([self.orders[h]]))
            effs = [efficiency(sim.mc, sim.pc, float(m)) for m in ms]
            good = [e for e in effs if e is not None]
            self.predicted[h] = {
                "makespan_s": float(ms.mean()),
                "p95_s": float(np.percentile(ms, 95)),
                "E": float(np.mean(good)) if good else float("nan"),
                "mc_s": sim.mc, "pc_s": sim.pc,
            }
        return self.predicted


def dag_for(model: nn.Module, name: str, kind: str, inputs: Any = None,
            labels: torch.Tensor | None = None) -> tuple[Dag, Dag, Traced | None]:
    """(the DAG planned on, its forward DAG, the trace): traced on the job's real ``inputs``
    when given (:func:`trace_inputs`: torch.fx, then torch.export; with ``labels=`` where
    the model computes its own loss), else symbolically."""
    traced = trace_inputs(model, inputs, name, labels) if inputs is not None else None
    gm = traced.gm if traced is not None else trace(model, name)
    fwd = build_dag(model, name, gm, traced.prefix if traced is not None else "")
    return (training_dag(fwd) if kind == "train" else fwd), fwd, traced


def plan_measured(model: nn.Module, example: Any, *, name: str, kind: str,
                  bytes_per_s: float, message_s: float = 0.0, execution: Execution = "eager",
                  runs: int = 5, run_dir: str | Path | None = None, device: str = "cpu",
                  loss: Callable[[Any], torch.Tensor] | None = None,
                  threads: int | None = 1, labels: torch.Tensor | None = None) -> Plan:
    """A plan for a real model on ``example`` (one tensor, a tuple or a mapping of tensors,
    as the job gives them): measured op times (cached in ``run_dir``), with as many
    intra-op threads as the ranks use (a cluster rank runs with 1 unless run.threads says
    otherwise; a 2-thread pool on a loaded 2-core machine turns a 10 us op into 15 ms).
    ``labels``: the job's labels where it calls the model with them (``loss: model``), so
    the graph traced and timed is the call its step makes (the plugin's
    ``job_labels``)."""
    dag, fwd, traced = dag_for(model, name, kind, example, labels)
    assert traced is not None
    fwd_fp = fwd.fingerprint()
    batch = int(traced.example[0].shape[0]) if traced.example else 0
    compute, where = None, ""
    if run_dir is not None:
        path = oracle.cache_path(run_dir, name, batch, device)
        where = str(path)
        compute = oracle.load_cached(path, fwd_fp)
        if compute is not None:
            where += " (cached)"
    if compute is None:
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            compute = oracle.measure(traced.gm, traced.example, runs=runs, loss=loss)
        except Exception as exc:  # noqa: BLE001 - a graph that does not run: the row says why
            raise UserError(f"tictac: the traced graph of model '{name}' ({traced.how}) does "
                            f"not run on the job's inputs to be timed: "
                            f"{error_text(exc)[:250]}") from None
        finally:
            torch.set_num_threads(before)
        compute.fingerprint = fwd_fp
        compute.key = {"model": name, "batch": batch, "device": device}
        if run_dir is not None:
            oracle.save_cached(oracle.cache_path(run_dir, name, batch, device), compute)
    times = oracle.op_times(dag, compute, bytes_per_s, message_s)
    return Plan(dag, compute, times, execution, bytes_per_s, message_s, cache=where,
                traced_by=traced.how)


def plan_meta(name: str, *, batch: int, kind: str, a: float = 1.0,
              execution: Execution = "dataflow") -> Plan:
    """A plan for one of the paper's models on the meta device, with the bandwidth chosen so
    that Mc / Pc = ``a``."""
    from accelopt_plugins.tictac.meta_models import build_meta

    model, shape = build_meta(name)
    gm = trace(model, name)
    fwd = build_dag(model, name, gm)
    annotate_costs(fwd, gm, torch.empty((batch, *shape), device="meta"))
    dag = training_dag(fwd) if kind == "train" else fwd
    compute = oracle.roofline(fwd)
    times = oracle.op_times(dag, compute, 1.0)
    bw = oracle.bandwidth_for_ratio(dag, times, a)
    times = oracle.op_times(dag, compute, bw)
    return Plan(dag, compute, times, execution, bw)


def with_ratio(plan: Plan, a: float) -> Plan:
    """The same DAG and compute times with the link set so that Mc / Pc = ``a``."""
    bw = oracle.bandwidth_for_ratio(plan.dag, plan.times, a)
    times = oracle.set_recv_times(plan.dag, plan.times, bw)
    return Plan(plan.dag, plan.compute, times, plan.execution, bw, 0.0)
