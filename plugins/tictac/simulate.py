"""Discrete-event simulation of one worker iteration: one link, one compute unit.

The link carries the recvs back to back in priority order (every parameter is available at
the server at t = 0, as in synchronous PS training). The compute unit runs ops once their
inputs are done: in ``eager`` mode strictly in program order (PyTorch), in ``dataflow``
mode the earliest-ready op first, ties by program order (TensorFlow's ready queue).

Metrics as the paper defines them (REFERENCE.md section 2): Mc = union of link-busy time,
Pc = union of compute, U = makespan, E = (Mc + Pc - U) / (Mc + Pc - max(Mc, Pc)).

Eager mode is vectorised over many orders at once (1000 random orders of ResNet-152 cost
well under a second): with all recvs queued at t = 0 the link finishes recv k at the prefix
sum of the times, and program order gives end_k = C_k + max_{j<=k}(need_j - C_{j-1}), where
C is the prefix sum of compute times and need_j the latest recv op j reads.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from accelopt_plugins.tictac.dag import RECV, Dag, Execution


@dataclass
class SimResult:
    makespan: float
    mc: float
    pc: float
    efficiency: float | None
    recv_end: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    op_start: dict[int, float] = field(repr=False, default_factory=dict)
    op_end: dict[int, float] = field(repr=False, default_factory=dict)


def efficiency(mc: float, pc: float, makespan: float) -> float | None:
    upper, lower = mc + pc, max(mc, pc)
    return (upper - makespan) / (upper - lower) if upper - lower > 1e-15 else None


class Simulator:
    """Simulates one DAG with fixed op times under any number of recv orders."""

    def __init__(self, dag: Dag, times: np.ndarray, execution: Execution = "eager") -> None:
        self.dag, self.execution = dag, execution
        self.times = np.asarray(times, dtype=np.float64)
        self.recv_t = self.times[dag.recvs]
        self.comp_t = self.times[dag.program]
        self.mc = float(self.recv_t.sum())
        self.pc = float(self.comp_t.sum())
        recv_index = {op: r for r, op in enumerate(dag.recvs)}
        # eager: for each compute op (program order), the recvs it reads directly
        flat, offsets = [], []
        for op in dag.program:
            offsets.append(len(flat))
            rs = [recv_index[i] for i in dag.inputs[op] if dag.kinds[i] == RECV]
            flat.extend(rs or [-1])
        self._flat = np.array(flat, dtype=np.int64)
        self._offsets = np.array(offsets, dtype=np.int64)
        self._csum = np.concatenate([[0.0], np.cumsum(self.comp_t)])
        self._recv_index = recv_index
        self._users = dag.users()

    # -- eager, vectorised ----------------------------------------------------------------

    def makespans(self, orders: np.ndarray) -> np.ndarray:
        """Makespan of each order (rows of recv indices); eager or dataflow."""
        orders = np.atleast_2d(np.asarray(orders, dtype=np.int64))
        if self.execution != "eager":
            return np.array([self.run(o).makespan for o in orders])
        return self._eager_makespans(orders)

    def _recv_end(self, orders: np.ndarray) -> np.ndarray:
        s, nr = orders.shape
        end = np.empty((s, nr))
        np.put_along_axis(end, orders, np.cumsum(self.recv_t[orders], axis=1), axis=1)
        return end

    def _eager_makespans(self, orders: np.ndarray) -> np.ndarray:
        end = self._recv_end(orders)
        if not len(self.dag.program):
            return end.max(axis=1) if end.size else np.zeros(len(orders))
        padded = np.concatenate([end, np.zeros((len(orders), 1))], axis=1)  # -1 -> 0
        gathered = padded[:, self._flat]
        need = np.maximum.reduceat(gathered, self._offsets, axis=1)
        slack = np.maximum.accumulate(need - self._csum[:-1], axis=1)
        comp_end = self._csum[-1] + slack[:, -1]
        return np.maximum(comp_end, end.max(axis=1) if end.size else 0.0)

    # -- one order, with the full timeline ---------------------------------------------------

    def run(self, order: list[int] | np.ndarray) -> SimResult:
        order = np.asarray(order, dtype=np.int64)
        recv_end = self._recv_end(order[None, :])[0] if len(order) else np.zeros(0)
        done: dict[int, float] = {op: float(recv_end[r]) for r, op in enumerate(self.dag.recvs)}
        start: dict[int, float] = {}
        if self.execution == "eager":
            t = 0.0
            for op in self.dag.program:
                ready = max([done[i] for i in self.dag.inputs[op]], default=0.0)
                start[op] = max(t, ready)
                t = start[op] + self.times[op]
                done[op] = t
        else:
            self._dataflow(done, start)
        comp_end = max((done[op] for op in self.dag.program), default=0.0)
        makespan = max(comp_end, float(recv_end.max()) if len(recv_end) else 0.0)
        return SimResult(makespan, self.mc, self.pc, efficiency(self.mc, self.pc, makespan),
                         recv_end, start, {op: done[op] for op in self.dag.program})

    def _dataflow(self, done: dict[int, float], start: dict[int, float]) -> None:
        dag = self.dag
        prog_index = {op: k for k, op in enumerate(dag.program)}
        missing = [len(ins) for ins in dag.inputs]
        heap: list[tuple[float, int, int]] = []

        def release(op: int, at: float) -> None:
            for u in self._users[op]:
                missing[u] -= 1
                if missing[u] == 0:
                    heapq.heappush(heap, (at, prog_index[u], u))

        for op in dag.program:
            if missing[op] == 0:
                heapq.heappush(heap, (0.0, prog_index[op], op))
        recv_events = sorted((done[op], op) for op in dag.recvs)
        k, t, left = 0, 0.0, len(dag.program)
        while left:
            while k < len(recv_events) and recv_events[k][0] <= t:
                release(recv_events[k][1], recv_events[k][0])
                k += 1
            if not heap:
                t = recv_events[k][0]
                continue
            _, _, op = heapq.heappop(heap)
            start[op] = t
            t += self.times[op]
            done[op] = t
            left -= 1
            release(op, t)

    # -- reports -------------------------------------------------------------------------------

    def chrome_trace(self, result: SimResult, order: list[int] | np.ndarray,
                     label: str = "") -> list[dict[str, Any]]:
        """Chrome-trace events (microseconds) for the link and compute tracks."""
        events: list[dict[str, Any]] = []
        pid = label or "simulated worker"
        for r in order:
            op = self.dag.recvs[int(r)]
            end = float(result.recv_end[int(r)])
            events.append({"name": self.dag.names[op], "ph": "X", "pid": pid, "tid": "link",
                           "ts": (end - self.recv_t[int(r)]) * 1e6,
                           "dur": self.recv_t[int(r)] * 1e6, "cat": "comm"})
        for op, s in result.op_start.items():
            events.append({"name": self.dag.names[op], "ph": "X", "pid": pid,
                           "tid": "compute", "ts": s * 1e6, "dur": self.times[op] * 1e6,
                           "cat": "compute"})
        return events


def summary(sim: Simulator, orders: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per named order set: mean and p95 makespan, mean E (one row per heuristic)."""
    out = {}
    for name, ords in orders.items():
        ms = sim.makespans(np.atleast_2d(ords))
        effs = [efficiency(sim.mc, sim.pc, float(m)) for m in ms]
        out[name] = {
            "makespan": float(ms.mean()),
            "p95": float(np.percentile(ms, 95)),
            "E": float(np.mean([e for e in effs if e is not None])) if effs[0] is not None
            else float("nan"),
        }
    return out
