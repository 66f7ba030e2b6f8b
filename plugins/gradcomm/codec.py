"""The gradient codec of one rank: error feedback, sparsification, casting, and back.

Why error feedback (Seide et al. 2014; Strom 2015; Lin et al., Deep Gradient Compression,
2018): sending only the large gradient entries (or rounding them to 16 bits) drops part of
each update. Keeping the dropped part in a per-rank residual and adding it to the next
gradient means nothing is lost, only delayed: after any number of steps,
``sum(sent) + residual == sum(gradients)`` on every rank (exactly, up to float32 rounding
of the running sums), which is what keeps sparse training converging.

Why momentum correction (DGC, Lin et al. 2018, section 3.2): with SGD momentum, sparsifying
the *gradient* and letting the optimizer apply momentum to the sparse sum is not momentum
SGD: a coordinate's delayed mass arrives in one lump and is then echoed by the momentum
buffer for ~1/(1-m) steps, which makes training oscillate when many small buckets each
release stale residuals. DGC moves the momentum before the sparsification: each rank keeps
its velocity ``u <- m*u + g`` and accumulates ``v <- v + u``, sends top-k of ``v``, and the
update applies the summed sent values *without* further momentum. Momentum factor masking
zeroes ``u`` (and ``v``) where a value was sent, so a sent coordinate's old momentum does
not keep pushing it. The invariant becomes ``sum(sent) + residual == sum(velocities)``;
without masking the velocities are exactly dense momentum SGD's (the update dense momentum
SGD applies, in units of the learning rate).

The job's optimizer (torch SGD with momentum m, dampening 0, no Nesterov) keeps its own
momentum buffer, which the plugin cannot reach through the hooks. The decoder cancels it
instead: it hands the optimizer ``S_t - m * S_{t-1}`` (``S`` the summed sent values of the
bucket), so the optimizer's buffer ``b_t = m*b_{t-1} + S_t - m*S_{t-1}`` equals ``S_t`` at
every step (``b_0 = S_0``) and the step is exactly ``w -= lr * S_t``. ``S`` is identical on
every rank (every rank decodes the same gathered payload), so the replicas stay identical.

Wire formats:

* dense (``sparsify=none``): the bucket as a tensor of ``dtype``; the transport all-reduces
  (sums) it, the decoder casts the sum back to the bucket's own dtype. At ``dtype=fp32``
  (lossless) a bucket goes as it is, in its own dtype (a float64 model's gradients stay
  float64), and the decoder leaves the sum alone.
* sparse (``topk``/``threshold``): the tuple ``(indices int32, values dtype)``, the values
  in the gradient's own dtype where that is narrower than ``dtype`` (a bf16 model's values
  are not widened to fp32; error feedback keeps the rounding either way). Sparse
  vectors of different ranks cannot be summed element-wise by ``all_reduce``, so the
  transport all-gathers the tuples; the decoder adds every rank's values into a dense
  float32 bucket, in rank order (the same order on every rank, so replicas stay identical),
  and casts it to the bucket's own dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class CodecStats:
    buckets: int = 0
    elements: int = 0
    sent_elements: int = 0
    dense_bytes: int = 0
    """What DDP's plain all-reduce would contribute per rank: every element in the
    gradient's own dtype (2 bytes for a bf16 model, 8 for a float64 one)."""
    wire_bytes: int = 0
    """What this rank encoded (indices + values for sparse buckets). The transport hands
    the collective more for a gathered bucket (padded to the longest rank's, plus the
    lengths): the plugin's report counts that."""


Bounds = tuple[float, float]
"""(smallest, largest) value of a tensor; a NaN makes both NaN."""


def extremes(values: torch.Tensor) -> Bounds:
    """One ``aminmax`` pass; ``(0.0, 0.0)`` for no values."""
    if values.numel() == 0:
        return 0.0, 0.0
    low, high = torch.aminmax(values)
    return float(low), float(high)


def within(values: torch.Tensor, limit: float = math.inf, bounds: Bounds | None = None) -> bool:
    """Every value finite and in ``[-limit, limit]``, from one ``aminmax`` pass, or none when
    the caller has the values' ``bounds`` already (the finiteness check and the cast check
    look at the same bucket). ``torch.isfinite(x).all()`` gives the same answer for
    ``limit=inf`` but costs ~15x more on a CPU (176 against 12 us for a 65,536-element
    float32 bucket), and it runs on every bucket of every iteration."""
    low, high = extremes(values) if bounds is None else bounds
    return math.isfinite(low) and math.isfinite(high) and -limit <= low and high <= limit


def _copy(value: Any) -> Any:
    """A copy of a carried value (a dict of tensors, or a plain value)."""
    if isinstance(value, dict):
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return value


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Where a bucket's error feedback (and DGC's velocity) accumulates: float32, or float64
    for a float64 bucket, so that its rounding to the wire dtype stays in the residual
    rather than being lost before error feedback sees it."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def model_budgets(candidates: dict[str, torch.Tensor], k_model: int) -> dict[str, int]:
    """Each bucket's share of the model-wide top ``k_model`` of the ``candidates``
    (magnitudes per bucket), at least 1. Counting every entry ``>=`` the K-th value
    over-counted its ties: where most of the gradient was exactly 0 (an embedding's unused
    rows), the K-th value was 0 and every zero counted, so a zero bucket's budget was its
    whole size and top-k at density 0.01 sent 90% of the elements. Here each bucket gets
    its entries strictly above the K-th value, and the rest of K goes to the tied entries
    (:func:`share_ties`), so the shares add up to K; without ties the shares are the
    ``>=`` counts, as before."""
    mags = torch.cat(list(candidates.values()))
    k = min(k_model, mags.numel())
    kth = torch.topk(mags, k).values.min()
    above: dict[str, int] = {}
    tied: dict[str, int] = {}
    for b, c in candidates.items():
        c = c if c.dtype == kth.dtype else c.to(kth.dtype)  # compared as the K-th was found
        above[b], tied[b] = int((c > kth).sum()), int((c == kth).sum())
    extra = share_ties(tied, k - sum(above.values()))
    return {b: max(1, above[b] + extra[b]) for b in candidates}


def share_ties(tied: dict[str, int], slots: int) -> dict[str, int]:
    """``slots`` places shared between buckets holding ``tied[b]`` entries equal to the K-th
    value, in proportion to ``tied`` (largest remainder, remainders tied broken by bucket
    name): integers only, so the same counts give the same shares on every rank and every
    run, whatever order the buckets were seen in. Never more than a bucket's tied entries
    (``slots`` is at most their sum); no slots, or no tied entry (a NaN K-th value), gives
    0 to every bucket."""
    total = sum(tied.values())
    if slots <= 0 or total == 0:
        return dict.fromkeys(tied, 0)
    slots = min(slots, total)
    share = {b: slots * t // total for b, t in tied.items()}
    rest = slots - sum(share.values())
    by_remainder = sorted(tied, key=lambda b: (-(slots * tied[b] % total), b))
    for b in by_remainder[:rest]:
        share[b] += 1
    return share


class CastOverflow(ArithmeticError):
    """A finite gradient became Inf when cast to the wire dtype (fp16 tops out at 65504)."""

    def __init__(self, bucket: str, index: torch.Tensor) -> None:
        self.bucket, self.index = bucket, index
        super().__init__(f"{bucket}: {index.numel()} value(s) overflow the wire dtype")


class BucketCodec:
    """Per-rank state and the encode/decode of gradient buckets (see the module docstring)."""

    def __init__(self, *, dtype: str = "fp32", sparsify: str = "none", density: float = 0.01,
                 threshold: float = 0.0, error_feedback: bool = True, momentum: float = 0.0,
                 factor_masking: bool = True, scope: str = "bucket") -> None:
        """``momentum`` > 0 turns on DGC's momentum correction with that factor (sparse
        modes with error feedback only: the caller checks); ``factor_masking`` zeroes the
        velocity where a value was sent. ``scope`` (top-k): ``bucket`` sends
        ``density`` of every bucket; ``model`` shares the budget ``density`` x (all gradient
        elements) between the buckets (see :meth:`budget_for`)."""
        self.dtype = WIRE_DTYPES[dtype]
        self.sparsify = sparsify
        self.density = float(density)
        self.threshold = float(threshold)
        self.error_feedback = error_feedback
        self.momentum = float(momentum)
        self.factor_masking = factor_masking
        self.residual: dict[str, torch.Tensor] = {}
        self.velocity: dict[str, torch.Tensor] = {}
        """Momentum correction: the rank's velocity ``u`` per bucket."""
        self.last_sum: dict[str, torch.Tensor] = {}
        """Momentum correction: the previous step's summed sent values per bucket (decoder)."""
        self.scope = scope
        self.candidates: dict[str, torch.Tensor] = {}
        """scope=model: each bucket's largest accumulated magnitudes at its last encode."""
        self.budget: dict[str, int] = {}
        self.budget_iteration: int | None = None
        """The step of the last top-k encode: a new step computes the next budget."""
        self.numel: dict[str, int] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        """Each bucket's own dtype (what the decoder gives back; what the report names)."""
        self.wire_dtypes: dict[str, torch.dtype] = {}
        """The dtype each bucket's values went in (what the report names)."""
        self.stats = CodecStats()

    STATE = ("residual", "velocity", "last_sum", "candidates", "budget", "budget_iteration",
             "numel")
    """What carries from one step to the next: a resumed run needs all of it to continue
    as the uninterrupted run would (the statistics are counted anew)."""

    def state_dict(self) -> dict[str, Any] | None:
        """The codec's carried state (copies), or ``None`` while it has none (lossless, or
        nothing encoded yet)."""
        if not (self.residual or self.velocity or self.last_sum or self.candidates):
            return None
        return {key: _copy(getattr(self, key)) for key in self.STATE}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.STATE:
            setattr(self, key, _copy(state[key]))

    @property
    def lossless(self) -> bool:
        return self.sparsify == "none" and self.dtype == torch.float32

    @property
    def corrected(self) -> bool:
        """DGC momentum correction is active (sparse, error feedback, momentum > 0)."""
        return self.momentum > 0 and self.sparsify != "none" and self.error_feedback

    def budget_for(self, name: str, n: int, iteration: int | None) -> int:
        """k for this bucket. ``bucket`` scope: ``ceil(density * n)``. ``model`` scope: the
        bucket's share of the last step's top ``K = ceil(density * all elements)`` over every
        bucket's accumulated values (how many of them it held), at least 1: top-k over the
        whole model, one step stale, while each bucket still leaves as soon as backward has
        produced it (overlap kept; the model-wide k-th value is only known after backward).
        Per-bucket top-k forces a small, dense-gradient bucket (the output layer) to wait
        ~1/density steps per entry; one bucket for the model avoids that but loses overlap.
        Ranks may choose different k (the all-gather takes any lengths); the first step of a
        run, and any bucket not seen yet, use the bucket scope. The budgets add up to K
        (plus one for each bucket holding none of the top K: every bucket sends at least
        one entry); entries tied with the K-th value are shared out by
        :func:`share_ties`."""
        own = max(1, math.ceil(self.density * n))
        if self.scope != "model" or iteration is None:
            return own
        previous, self.budget_iteration = self.budget_iteration, iteration
        if previous is not None and iteration != previous and self.candidates:
            total = sum(self.numel[b] for b in self.candidates)
            k_model = max(1, math.ceil(self.density * total))
            self.budget = model_budgets(self.candidates, k_model)
        return min(n, self.budget.get(name, own))

    def select(self, name: str, acc: torch.Tensor, iteration: int | None = None) -> torch.Tensor:
        """Indices (sorted, int64) of the entries to send this step."""
        if self.sparsify == "topk":
            k = self.budget_for(name, acc.numel(), iteration)
            if self.scope == "model":  # keep this bucket's candidates for the next budget
                # the model's top K can hold at most K of a bucket's values; before the first
                # budget (first step) K is not known yet (buckets still to come): keep all
                k_model = math.ceil(self.density * sum(self.numel.values()))
                keep = acc.numel() if not self.budget else min(acc.numel(), max(k, k_model))
                values, order = torch.topk(acc.abs(), keep, sorted=True)
                self.candidates[name] = values
                idx = order[:k]
            else:
                idx = torch.topk(acc.abs(), k, sorted=False).indices
        else:
            idx = torch.nonzero(acc.abs() >= self.threshold).reshape(-1)
        return torch.sort(idx).values

    def encode(self, name: str, flat: torch.Tensor, iteration: int | None = None,
               bounds: Bounds | None = None) -> Any | None:
        """``flat``: the rank's (weighted) float32 bucket of step ``iteration``; ``bounds``:
        its extremes when the caller has measured them (then the cast check of a bucket sent
        as it is makes no pass of its own). Returns the wire payload, or ``None`` when the
        codec is lossless (the bucket goes as it is, in its own dtype)."""
        self.dtypes[name] = flat.dtype
        if self.lossless:
            return None
        flat = flat.detach().reshape(-1)
        n = flat.numel()
        self.numel[name] = n
        acc = flat.to(_accumulator(flat.dtype))
        velocity = None
        if self.corrected:
            velocity = self.velocity.get(name)
            velocity = acc.clone() if velocity is None else velocity.mul_(self.momentum).add_(acc)
            self.velocity[name] = velocity
            acc = velocity.clone()
            bounds = None
        residual = self.residual.get(name)
        if self.error_feedback and residual is not None:
            acc = acc + residual
            bounds = None
        st = self.stats
        st.buckets += 1
        st.elements += n
        st.dense_bytes += n * flat.element_size()
        wire_dtype = self.wire_dtypes[name] = self.wire_dtype(flat.dtype)
        if self.sparsify == "none":
            wire = acc.to(wire_dtype)
            self._check_cast(name, acc, wire, bounds)
            if self.error_feedback:
                self.residual[name] = acc - wire.to(acc.dtype)
            st.sent_elements += n
            st.wire_bytes += wire.numel() * wire.element_size()
            return wire
        idx = self.select(name, acc, iteration)
        values = acc[idx].to(wire_dtype)
        self._check_cast(name, acc[idx], values)
        if self.error_feedback:
            rest = acc.clone()
            rest[idx] -= values.to(rest.dtype)  # 0 at the wire's precision, else its rounding
            self.residual[name] = rest
        if velocity is not None and self.factor_masking:
            velocity[idx] = 0.0
        wire_idx = idx.to(torch.int32)
        st.sent_elements += idx.numel()
        st.wire_bytes += (wire_idx.numel() * wire_idx.element_size()
                          + values.numel() * values.element_size())
        return (wire_idx, values)

    def wire_dtype(self, own: torch.dtype) -> torch.dtype:
        """The configured ``dtype``, or the gradient's own where it takes fewer bytes: the
        default ``fp32`` would widen a bf16 model's top-k values to 4 bytes, where DDP sends
        its gradients in 2."""
        if own.is_floating_point and own.itemsize < self.dtype.itemsize:
            return own
        return self.dtype

    def _check_cast(self, name: str, before: torch.Tensor, after: torch.Tensor,
                    bounds: Bounds | None = None) -> None:
        """Raise :class:`CastOverflow` where a finite float32 value became Inf. Values within
        the wire dtype's range cannot round past it, so one pass over the float32 side
        settles the common case (``isfinite`` over 16-bit values is ~20x slower on a CPU);
        only a bucket with a value out of range (or a NaN) is scanned element by element."""
        if (after.dtype == torch.float32
                or within(before, torch.finfo(after.dtype).max, bounds)):
            return
        index = torch.nonzero(~torch.isfinite(after) & torch.isfinite(before)).reshape(-1)
        if index.numel():  # a value that was not finite before the cast is not the cast's
            raise CastOverflow(name, index)

    def decode(self, name: str, payload: Any) -> torch.Tensor | None:
        """Lossless: nothing to do (``None``: the sum is the bucket's, in its own dtype).
        Dense: the summed tensor back in the bucket's dtype. Sparse: every rank's (indices,
        values) added into a dense float32 bucket, in rank order; with momentum correction,
        minus ``m`` times the previous sum (cancels the optimizer's momentum, module
        docstring); then cast to the bucket's dtype."""
        dtype = self.dtypes.get(name, torch.float32)
        if isinstance(payload, torch.Tensor):
            return None if self.lossless or payload.dtype == dtype else payload.to(dtype)
        if isinstance(payload, list):
            return self._sparse_sum(name, payload).to(dtype)
        return None

    def _sparse_sum(self, name: str, payload: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> torch.Tensor:
        device = payload[0][1].device if payload else torch.device("cpu")
        out = torch.zeros(self.numel[name], dtype=torch.float32, device=device)
        for idx, values in payload:
            out.index_add_(0, idx.long(), values.float())
        if not self.corrected:
            return out
        previous = self.last_sum.get(name)
        self.last_sum[name] = out
        return out if previous is None else out - self.momentum * previous
