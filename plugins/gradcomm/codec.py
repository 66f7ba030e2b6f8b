"""The gradient codec of one rank: error feedback, sparsification, casting, and back.

Why error feedback (Seide et al. 2014; Strom 2015; Lin et al., Deep Gradient Compression,
2018): sending only the large gradient entries (or rounding them to 16 bits) drops part of
each update. Keeping the dropped part in a per-rank residual and adding it to the next
gradient means nothing is lost, only delayed: after any number of steps,
``sum(sent) + residual == sum(gradients)`` on every rank (exactly, up to float32 rounding
of the running sums), which is what keeps sparse training converging.

Wire formats:

* dense (``sparsify=none``): the bucket as a tensor of ``dtype``; the transport all-reduces
  (sums) it, the decoder casts the sum back to float32.
* sparse (``topk``/``threshold``): the tuple ``(indices int32, values dtype)``. Sparse
  vectors of different ranks cannot be summed element-wise by ``all_reduce``, so the
  transport all-gathers the tuples; the decoder adds every rank's values into a dense
  float32 bucket, in rank order (the same order on every rank, so replicas stay identical).
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
    """What the plain float32 all-reduce would contribute per rank."""
    wire_bytes: int = 0
    """What this rank contributed (indices + values for sparse buckets)."""


class CastOverflow(ArithmeticError):
    """A finite gradient became Inf when cast to the wire dtype (fp16 tops out at 65504)."""

    def __init__(self, bucket: str, index: torch.Tensor) -> None:
        self.bucket, self.index = bucket, index
        super().__init__(f"{bucket}: {index.numel()} value(s) overflow the wire dtype")


class BucketCodec:
    """Per-rank state and the encode/decode of gradient buckets (see the module docstring)."""

    def __init__(self, *, dtype: str = "fp32", sparsify: str = "none", density: float = 0.01,
                 threshold: float = 0.0, error_feedback: bool = True) -> None:
        self.dtype = WIRE_DTYPES[dtype]
        self.sparsify = sparsify
        self.density = float(density)
        self.threshold = float(threshold)
        self.error_feedback = error_feedback
        self.residual: dict[str, torch.Tensor] = {}
        self.numel: dict[str, int] = {}
        self.stats = CodecStats()

    @property
    def lossless(self) -> bool:
        return self.sparsify == "none" and self.dtype == torch.float32

    def select(self, acc: torch.Tensor) -> torch.Tensor:
        """Indices (sorted, int64) of the entries to send this step."""
        if self.sparsify == "topk":
            k = max(1, math.ceil(self.density * acc.numel()))
            idx = torch.topk(acc.abs(), k, sorted=False).indices
        else:
            idx = torch.nonzero(acc.abs() >= self.threshold).reshape(-1)
        return torch.sort(idx).values

    def encode(self, name: str, flat: torch.Tensor) -> Any | None:
        """``flat``: the rank's (weighted) float32 bucket. Returns the wire payload, or
        ``None`` when the codec is lossless (plain float32, nothing to do)."""
        if self.lossless:
            return None
        flat = flat.detach().reshape(-1)
        n = flat.numel()
        self.numel[name] = n
        acc = flat.float()
        residual = self.residual.get(name)
        if self.error_feedback and residual is not None:
            acc = acc + residual
        st = self.stats
        st.buckets += 1
        st.elements += n
        st.dense_bytes += n * 4
        if self.sparsify == "none":
            wire = acc.to(self.dtype)
            self._check_cast(name, acc, wire)
            if self.error_feedback:
                self.residual[name] = acc - wire.float()
            st.sent_elements += n
            st.wire_bytes += wire.numel() * wire.element_size()
            return wire
        idx = self.select(acc)
        values = acc[idx].to(self.dtype)
        self._check_cast(name, acc[idx], values)
        if self.error_feedback:
            rest = acc.clone()
            rest[idx] -= values.float()  # exactly 0 in float32; the rounding error in 16 bits
            self.residual[name] = rest
        wire_idx = idx.to(torch.int32)
        st.sent_elements += idx.numel()
        st.wire_bytes += (wire_idx.numel() * wire_idx.element_size()
                          + values.numel() * values.element_size())
        return (wire_idx, values)

    def _check_cast(self, name: str, before: torch.Tensor, after: torch.Tensor) -> None:
        if after.dtype == torch.float32:
            return
        bad = ~torch.isfinite(after)
        if bool(bad.any()):
            raise CastOverflow(name, torch.nonzero(bad & torch.isfinite(before)).reshape(-1))

    def decode(self, name: str, payload: Any) -> torch.Tensor | None:
        """Dense: the summed tensor back in float32. Sparse: every rank's (indices, values)
        added into a dense float32 bucket, in rank order."""
        if isinstance(payload, torch.Tensor):
            return None if payload.dtype == torch.float32 else payload.float()
        if isinstance(payload, list):
            device = payload[0][1].device if payload else torch.device("cpu")
            out = torch.zeros(self.numel[name], dtype=torch.float32, device=device)
            for idx, values in payload:
                out.index_add_(0, idx.long(), values.float())
            return out
        return None
