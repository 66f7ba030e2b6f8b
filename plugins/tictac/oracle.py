"""The time oracle: how long each op takes, per (model, batch, device).

Compute: every forward fx node is timed over several runs and the **minimum** kept (as the
authors do: the minimum is the op's cost without interference). Backward is timed as a
whole (min over runs) and split over the ops in proportion to their forward time, because
autograd does not expose per-node backward timings without a profiler. Models on the meta
device cannot run, so they get a roofline estimate from FLOPs and bytes touched.

Transfers: bytes / bandwidth (+ an optional per-message cost, measured from the transport
when it is available, since gloo's per-message latency is not negligible on a CPU).

Measured times are cached as JSON in the run directory, keyed by (model, batch, device) and
the DAG's fingerprint; a cache written for another structure is stale and rebuilt with a
warning.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from accelopt_plugins.tictac.dag import RECV, Dag

from accelopt.job.job import logits_of


@dataclass
class ComputeTimes:
    """Forward seconds per compute op name, plus the total backward seconds."""

    forward: dict[str, float]
    backward_s: float
    source: str  # "measured" | "roofline"
    runs: int = 0
    fingerprint: str = ""
    spread: float = 0.0
    """Median over ops of (median / min - 1): the run-to-run variation on this machine."""
    key: dict[str, Any] = field(default_factory=dict)


class _TimedInterpreter(fx.Interpreter):
    """Times each node; on CUDA it synchronises around each node (kernels are async)."""

    def __init__(self, gm: fx.GraphModule, cuda: bool = False) -> None:
        super().__init__(gm)
        self.samples: dict[str, list[float]] = {}
        self.cuda = cuda

    def run_node(self, n: fx.Node) -> Any:
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = super().run_node(n)
        if self.cuda:
            torch.cuda.synchronize()
        if n.op not in ("placeholder", "output", "get_attr"):
            self.samples.setdefault(n.name, []).append(time.perf_counter() - t)
        return out


def measure(gm: fx.GraphModule, example: torch.Tensor | tuple[torch.Tensor, ...],
            runs: int = 5, loss: Any = None) -> ComputeTimes:
    """Min over ``runs`` of each forward node; min over ``runs`` of one backward.
    ``example``: the graph's input, or its flat inputs (a graph from ``torch.export``)."""
    args = example if isinstance(example, tuple) else (example,)
    cuda = bool(args) and args[0].device.type == "cuda"
    interp = _TimedInterpreter(gm, cuda)
    with torch.no_grad():
        interp.run(*args)  # warm-up (allocations, lazy init), not counted
        interp.samples.clear()
        for _ in range(runs):
            interp.run(*args)
    forward = {k: min(v) for k, v in interp.samples.items()}
    spread = float(np.median([np.median(v) / max(min(v), 1e-12) - 1
                              for v in interp.samples.values()])) if forward else 0.0
    backward = []
    if any(p.requires_grad for p in gm.parameters()):
        for _ in range(runs + 1):
            out = gm(*args)
            value = loss(out) if loss is not None else _sum_loss(out)
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            value.backward()
            if cuda:
                torch.cuda.synchronize()
            backward.append(time.perf_counter() - t)
            gm.zero_grad(set_to_none=True)
    return ComputeTimes(forward, min(backward[1:]) if len(backward) > 1 else 0.0, "measured",
                        runs, spread=spread)


def update_bytes_per_s(model: torch.nn.Module, runs: int = 3) -> float:
    """How fast a server updates parameters: an SGD step with momentum over a copy of the
    model's parameters (min over ``runs``), in parameter bytes per second. The cross-iteration
    simulator charges a tensor's update at this rate (Adam does about twice the work)."""
    params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    if not params:
        return float("inf")
    for p in params:
        p.grad = torch.ones_like(p)
    step = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    step.step()  # the momentum buffers are made here, not timed
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        step.step()
        best = min(best, time.perf_counter() - t)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return nbytes / best if best > 0 else float("inf")


def _sum_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    if isinstance(out, Mapping):  # an HF ModelOutput: its loss if it has one, else logits
        first = out.get("loss", out.get("logits"))
        return _sum_loss(first if first is not None else list(out.values()))
    if isinstance(out, (list, tuple)):
        return sum(_sum_loss(o) for o in out if o is not None)  # type: ignore[return-value]
    own = getattr(out, "loss", None)  # an output object (a dataclass): its loss, else logits
    if isinstance(own, torch.Tensor):
        return own.float().sum()
    logits = logits_of(out)
    if logits is not out:
        return _sum_loss(logits)
    raise TypeError(f"cannot make a loss from {type(out).__name__}")


def roofline(dag: Dag, flops_per_s: float = 15e12, bytes_per_s: float = 900e9) -> ComputeTimes:
    """Meta-device estimate: max(FLOPs / peak, bytes / memory bandwidth) per op (defaults:
    a V100-class GPU; only the relative costs matter once the bandwidth is set for a given a)."""
    fwd_ops = [op for op in dag.program if op not in dag.backward_of]
    forward = {dag.names[op]: max(dag.flops[op] / flops_per_s, dag.mem_bytes[op] / bytes_per_s)
               for op in fwd_ops}
    return ComputeTimes(forward, 2.0 * sum(forward.values()), "roofline",
                        fingerprint=dag.fingerprint())


def op_times(dag: Dag, compute: ComputeTimes, bytes_per_s: float,
             message_s: float = 0.0) -> np.ndarray:
    """Seconds per op of ``dag``: recvs from bytes and the link, compute from the oracle;
    backward ops share the measured backward time in proportion to forward time."""
    times = np.zeros(dag.n)
    for op in dag.recvs:
        times[op] = message_s + dag.nbytes[op] / bytes_per_s
    fwd_total = 0.0
    for op in dag.program:
        if op not in dag.backward_of:
            times[op] = compute.forward.get(dag.names[op], 0.0)
            fwd_total += times[op]
    for op, f in dag.backward_of.items():
        share = times[f] / fwd_total if fwd_total > 0 else 1.0 / max(1, len(dag.backward_of))
        times[op] = compute.backward_s * share
    return times


def bandwidth_for_ratio(dag: Dag, times: np.ndarray, a: float) -> float:
    """Bytes/s that makes Mc / Pc = ``a`` for this DAG's compute times."""
    pc = float(sum(times[op] for op in dag.program))
    total = float(sum(dag.nbytes[op] for op in dag.recvs))
    return total / (a * pc)


def set_recv_times(dag: Dag, times: np.ndarray, bytes_per_s: float,
                   message_s: float = 0.0) -> np.ndarray:
    out = times.copy()
    for op in dag.recvs:
        if dag.kinds[op] == RECV:
            out[op] = message_s + dag.nbytes[op] / bytes_per_s
    return out


# -- cache -----------------------------------------------------------------------------------


def cache_path(run_dir: str | Path, model: str, batch: int, device: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    return Path(run_dir) / "tictac" / f"oracle-{safe}-b{batch}-{device}.json"


def load_cached(path: Path, fingerprint: str) -> ComputeTimes | None:
    """The cached times, or None when missing; a stale cache (another structure) warns."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        cached = ComputeTimes(**data)
    except (ValueError, TypeError) as exc:
        warnings.warn(f"tictac: unreadable oracle cache {path} ({exc}); re-measuring",
                      RuntimeWarning, stacklevel=2)
        return None
    if cached.fingerprint != fingerprint:
        warnings.warn(
            f"tictac: oracle cache {path} was written for another model structure "
            f"(fingerprint {cached.fingerprint} != {fingerprint}); stale, re-measuring",
            RuntimeWarning, stacklevel=2)
        return None
    return cached


def save_cached(path: Path, times: ComputeTimes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{time.time_ns()}")
    tmp.write_text(json.dumps(asdict(times), indent=1, sort_keys=True))
    tmp.replace(path)


# -- the link, from what the transport observed -----------------------------------------------


def fit_link(samples: list[tuple[float, float, int]],
             bytes_per_s: float | None = None) -> tuple[float, float] | None:
    """(per-message seconds, bytes/s) from observed transfers, or None when they give no
    plausible link (:func:`fit_link_or_why` says why)."""
    fit = fit_link_or_why(samples, bytes_per_s)
    return None if isinstance(fit, str) else fit


def fit_link_or_why(samples: list[tuple[float, float, int]],
                    bytes_per_s: float | None = None) -> tuple[float, float] | str:
    """(per-message seconds, bytes/s) from observed transfers (start_s, end_s, nbytes) of
    one receiver, or why they give none: consecutive arrivals on a busy link are spaced by
    one transfer's time, so gap = alpha + bytes / bandwidth is a least-squares line. With a
    known rate (a shaped link) only alpha is fitted, as the median of gap - bytes / rate
    (robust to the CPU contention that spreads single gaps).

    A line fitted where the sizes do not explain the spacing (a server's shard of many tiny
    tensors: the gaps are per-message cost and noise) is refused rather than trusted: a slope
    <= 0 (no rate at all), a negative per-message cost, or a rate below half of what the
    same arrivals' bytes over their measured time give. Such a fit read 262 B/s where the
    transfers moved their bytes far faster, and predicted makespans of 46 s for a 0.23 s
    run; a caller keeps its assumed rate instead."""
    if len(samples) < 3:
        return f"{len(samples)} arrival{'' if len(samples) == 1 else 's'}, too few to fit"
    if bytes_per_s:
        ordered = sorted(samples, key=lambda s: s[1])
        rest = [end - max(prev_end, start) - nbytes / bytes_per_s
                for (_, prev_end, _), (start, end, nbytes) in zip(ordered, ordered[1:],
                                                                  strict=False)
                if end - max(prev_end, start) > 0]
        return (max(0.0, float(np.median(rest))) if rest else 0.0, float(bytes_per_s))
    samples = sorted(samples, key=lambda s: s[1])
    gaps, sizes = [], []
    for (_, prev_end, _), (start, end, nbytes) in zip(samples, samples[1:], strict=False):
        gap = end - max(prev_end, start)
        if gap > 0:
            gaps.append(gap)
            sizes.append(nbytes)
    if len(gaps) < 3 or len(set(sizes)) < 2:
        total = sum(s[2] for s in samples)
        busy = sum(gaps) if gaps else 0.0
        if busy > 0:
            return (0.0, total / busy)
        return "the arrivals are too close together to fit a rate"
    overall = sum(sizes) / sum(gaps)  # bytes over their measured time: what they did move
    A = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=np.float64)], axis=1)
    (alpha, inv_bw), *_ = np.linalg.lstsq(A, np.asarray(gaps), rcond=None)
    if inv_bw <= 0:
        return (f"the fitted line's slope is {inv_bw:.3g} s/byte (<= 0): the arrivals' "
                "spacing does not grow with their size, so it gives no rate")
    fitted = 1.0 / float(inv_bw)
    scale = float(np.median(gaps))
    if fitted < 0.5 * overall:
        return (f"the fitted rate {fitted:.4g} B/s is below half of the {overall:.4g} B/s the "
                "same arrivals' bytes over their measured time give: the sizes do not explain "
                "the spacing")
    if alpha < -0.5 * scale:
        return (f"the fitted per-message cost is {1e3 * alpha:.3g} ms (negative): the sizes "
                "do not explain the arrivals' spacing")
    return (max(0.0, float(alpha)), fitted)
