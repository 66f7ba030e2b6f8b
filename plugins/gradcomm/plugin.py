"""gradcomm's hooks: the codec on the send/recv hook point of all-reduce buckets, the
overlap switch on the order hook, and the non-finite guard that names the layer."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from accelopt_plugins.gradcomm.codec import BucketCodec, CastOverflow, extremes, within
from accelopt_plugins.gradcomm.config import GradcommConfig, momentum_factor, validate

from accelopt import JobInfo, ReportRow, RunInfo, TransferRecord, hookimpl
from accelopt.drivers.cluster.transport import allreduce_wire_bytes
from accelopt.errors import AccelOptError, UserError
from accelopt.types import INERT
from accelopt.units import format_bytes

ALL_RANKS = -1


class NonFiniteGradient(AccelOptError):
    """A gradient bucket held NaN/Inf (or overflowed the wire dtype): it is not sent, so it
    cannot spread to the other workers' replicas; the run stops naming the layer."""


Span = tuple[str, str, int, int]
"""(parameter name, owning module path, first element, end element) inside a bucket."""


class GradcommPlugin:
    """One instance per job and rank (job-scoped; each cluster process activates its own),
    so the error-feedback residuals are naturally per job and per rank."""

    def __init__(self, config: GradcommConfig) -> None:
        self.config = config
        self.codec = BucketCodec()
        self.job: JobInfo | None = None
        self.mode = "none"
        self.bucket_mb: float | None = None
        self.layout: dict[str, list[Span]] | None = None
        self.bucket_names: set[str] = set()
        self.iterations: set[int] = set()
        self.refused_non_finite = False
        """The guard stopped a bucket (NaN/Inf, or an overflow of the wire dtype): the run
        then ended where a run without gradcomm would have sent it on."""
        self.workers = 2
        """The ranks of the all-reduce (the run's ``cluster.workers``)."""
        self.sent_bytes = 0
        """What this rank sent on its links for its buckets (``record.wire_bytes``): a
        gathered sparse bucket is padded to the longest rank's, plus its lengths message,
        and goes to every other rank."""
        self.dense_wire_bytes = 0
        """What DDP's plain all-reduce of the same buckets would have sent on this rank's
        links at the same number of ranks: the ratio compares wire with wire."""

    @hookimpl
    def accelopt_configure(self, config: GradcommConfig, run_config: Any) -> None:
        validate(config)
        self.config = config
        cluster = run_config.get("cluster") if run_config is not None else None
        if cluster is not None:
            self.mode = str(cluster.get("mode", "none"))
            self.workers = int(cluster.get("workers", self.workers) or self.workers)
            self.bucket_mb = float(cluster.get("bucket_mb", 0) or 0) or None
        jobs = _job_optimizers(run_config)
        for optimizer, momentum in jobs or [(None, 0.0)]:  # refuse what cannot apply, up front
            momentum_factor(config, optimizer, momentum)
        self.codec = self._codec(*(jobs[0] if jobs else (None, 0.0)))

    def _codec(self, optimizer: str | None, momentum: float) -> BucketCodec:
        c = self.config
        return BucketCodec(dtype=c.dtype, sparsify=c.sparsify, density=c.density,
                           threshold=c.threshold, error_feedback=c.error_feedback,
                           momentum=momentum_factor(c, optimizer, momentum),
                           factor_masking=c.factor_masking, scope=c.topk_scope)

    @hookimpl
    def accelopt_run_start(self, run: RunInfo) -> None:
        """The job this instance serves (its optimizer, parameter table and buckets) and the
        run's mode come from the run's record."""
        self.mode = run.cluster.mode
        self.workers = run.cluster.workers
        self.bucket_mb = run.cluster.bucket_bytes / 2**20
        if run.job is not None:
            self.job = run.job
            self.codec = self._codec(run.job.optimizer, run.job.momentum)

    # -- checkpoints -------------------------------------------------------------------

    @hookimpl
    def accelopt_state_save(self, job: JobInfo) -> dict[str, Any] | None:
        """The error-feedback residuals (and DGC's velocities) of this rank: without them a
        resumed run would drop what the last steps held back. With the options they were
        made under (``options``), which a load compares with its own."""
        state = self.codec.state_dict()
        if state is not None:
            state["options"] = self._state_options()
        return state

    @hookimpl
    def accelopt_state_load(self, job: JobInfo, state: dict[str, Any]) -> None:
        """Refused in one line when the state was saved under other options: loaded as it
        was, a state of other bucket sizes failed at the first backward inside the encoder
        with torch's "The size of tensor a (132) must match the size of tensor b (1476)",
        and a top-k state loaded into an fp16 codec was accepted silently (its residuals
        added into the fp16 gradients, and saved again with the next state)."""
        self._refuse_other_options(state)
        self.codec.load_state_dict(state)

    def _state_options(self) -> dict[str, Any]:
        """The options the carried state depends on (``None`` where one does not apply):
        the wire dtype, the sparsifier and its density or threshold, error feedback, DGC's
        momentum factor (0: off), factor masking, top-k's scope and the bucket size."""
        codec, c = self.codec, self.config
        topk, corrected = codec.sparsify == "topk", codec.corrected
        return {"dtype": c.dtype, "sparsify": codec.sparsify,
                "density": codec.density if topk else None,
                "threshold": codec.threshold if codec.sparsify == "threshold" else None,
                "error_feedback": codec.error_feedback,
                "momentum": codec.momentum if corrected else 0.0,
                "factor_masking": codec.factor_masking if corrected else None,
                "topk_scope": codec.scope if topk else None,
                "bucket_mb": self.bucket_mb}

    def _refuse_other_options(self, state: dict[str, Any]) -> None:
        """The options that differ from the saved state's, or a saved bucket whose
        size is not this job's (the same options on another model), in one line."""
        fix = ("make the hook (or run) with the options the state was saved with, or start "
               "without the saved gradcomm state")
        saved = state.get("options")
        if isinstance(saved, dict):
            mine = self._state_options()
            differ = [key for key, value in mine.items() if key in saved and saved[key] != value]
            if differ:
                then = ", ".join(f"{key}={_shown(saved[key], key)}" for key in differ)
                now = ", ".join(f"{key}={_shown(mine[key], key)}" for key in differ)
                raise UserError(f"gradcomm: the saved state was made with {then}; this hook "
                                f"has {now}; {fix}")
        layout = self._layout()
        for name, numel in (state.get("numel") or {}).items():
            spans = layout.get(name)
            size = spans[-1][3] if spans else None
            if layout and size != numel:
                have = f"has {size} elements" if size is not None else "does not exist"
                raise UserError(f"gradcomm: the saved state's {name} holds {numel} gradient "
                                f"elements, and this job's {name} {have} (another model or "
                                f"bucket size); {fix}")

    # -- send / recv -------------------------------------------------------------------

    @staticmethod
    def _ours(record: TransferRecord) -> bool:
        return record.kind == "grad" and record.destination == ALL_RANKS

    @hookimpl
    def accelopt_transfer_order(self, transfers: Sequence[TransferRecord],
                                destination: int) -> list[str] | None:
        if self.config.overlap or destination != ALL_RANKS:
            return None
        if not transfers or not all(self._ours(t) and t.tensor.startswith("bucket")
                                    for t in transfers):
            return None
        # the bucket of the first layers is the last one backward produces: naming it first
        # holds every bucket until backward has ended (no overlap)
        return [t.tensor for t in sorted(transfers, key=lambda t: -int(t.tensor[6:]))]

    @hookimpl
    def accelopt_transfer_encode(self, record: TransferRecord, payload: Any) -> Any | None:
        if not self._ours(record) or not isinstance(payload, torch.Tensor):
            return None
        self.bucket_names.add(record.tensor)
        self.iterations.add(record.iteration)
        bounds = None
        if self.config.check_finite:
            bounds = extremes(payload)  # one pass serves this check and the cast's
            if not within(payload, bounds=bounds):
                self.refused_non_finite = True
                raise NonFiniteGradient(self._describe(record, payload, "non-finite gradient"))
        try:
            return self.codec.encode(record.tensor, payload, record.iteration, bounds)
        except CastOverflow as exc:
            marked = torch.zeros_like(payload)
            marked[exc.index] = float("inf")
            self.refused_non_finite = True
            raise NonFiniteGradient(self._describe(
                record, marked, f"gradient overflows {self.config.dtype}",
                fix="use plugins.gradcomm.dtype=bf16 (same range as float32) or scale the loss",
            )) from None

    @hookimpl
    def accelopt_transfer_decode(self, record: TransferRecord, payload: Any) -> Any | None:
        if not self._ours(record):
            return None
        return self.codec.decode(record.tensor, payload)

    @hookimpl
    def accelopt_transfer_done(self, record: TransferRecord, start_s: float,
                               end_s: float) -> None:
        if self._ours(record) and record.tensor in self.bucket_names:
            self.sent_bytes += record.wire_bytes
            self.dense_wire_bytes += allreduce_wire_bytes(record.nbytes, self.workers)

    # -- non-finite gradients ------------------------------------------------------------

    def _describe(self, record: TransferRecord, flat: torch.Tensor, what: str,
                  fix: str = "lower the learning rate or clip gradients") -> str:
        flat = flat.detach().reshape(-1)
        nan, inf = torch.isnan(flat), torch.isinf(flat)
        where = "an unknown layer"
        layout = self._layout().get(record.tensor, [])
        for param, module, lo, hi in layout:
            n_nan, n_inf = int(nan[lo:hi].sum()), int(inf[lo:hi].sum())
            if n_nan or n_inf:
                where = f"layer '{module or '<model>'}' ({param}: {n_nan} NaN, {n_inf} Inf)"
                break
        # counted from 0, as the run's own "at iteration N" stop lines count; said so, since
        # the run's divergence line counts losses from 1 ("loss 3 of 8" for iteration 2)
        return (f"rank {record.source}, iteration {record.iteration} (counted from 0): {what} "
                f"in {where}, "
                f"{record.tensor}; not sent, so no other worker received it; {fix}")

    def _layout(self) -> dict[str, list[Span]]:
        """bucket name -> the parameters it holds, from the job's record (its parameter table
        and buckets, exactly those the core sends). Built only when needed (an error)."""
        if self.layout is not None:
            return self.layout
        self.layout = {}
        job = self.job
        if job is None:
            return self.layout
        for b, bucket in enumerate(job.buckets):
            spans, offset = [], 0
            for index in bucket:
                p = job.parameters[index]
                n = p.numel * 2 if p.dtype.startswith("complex") else p.numel  # (re, im)
                spans.append((p.name, p.module, offset, offset + n))
                offset += n
            self.layout[f"bucket{b}"] = spans
        return self.layout

    # -- report --------------------------------------------------------------------------

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        c = self.config
        if self.mode != "allreduce":
            return [ReportRow("gradcomm", f"nothing to do: gradcomm acts on the gradient buckets "
                              f"of cluster.mode=allreduce; this run is cluster.mode={self.mode}",
                              {INERT: 1})]
        st = self.codec.stats
        iters = max(1, len(self.iterations))
        fusion = (f"{len(self.bucket_names)} bucket(s) closed at {_mib(self.bucket_mb)} MiB"
                  if self.bucket_mb else f"{len(self.bucket_names)} bucket(s)")
        overlap = "overlapping backward" if c.overlap else "held until backward ended"
        if self.codec.lossless:
            text = (f"{_dtype_names(self.codec.dtypes.values())} dense all-reduce (no "
                    f"compression), {fusion}, {overlap}")
            plain: dict[str, float | int | str] = {"buckets": len(self.bucket_names)}
            if c.overlap and not self.refused_non_finite:
                # each bucket went as it was, in the core's buckets, the moment backward
                # produced it: the bytes, numerics, fusion and order of a run without
                # gradcomm (tested bitwise). What is left is time: a transfer hook keeps the
                # buckets off the transport's direct all-reduce, and the guard reads them.
                guard = (", and read each for NaN/Inf: none found" if c.check_finite else "")
                text += (": what a run without gradcomm does (same bytes, values, buckets and "
                         "order), so it changed nothing (its hooks only routed the buckets through "
                         f"the transport's hooked path, not its direct all-reduce{guard})")
                plain[INERT] = 1
            return [ReportRow("gradcomm", text, plain)]
        scope = "k over the model" if c.topk_scope == "model" else "k per bucket"
        method = {"none": "dense", "topk": f"top-k density {c.density:g} ({scope})",
                  "threshold": f"threshold {c.threshold:g}"}[c.sparsify]
        # on the wire, against a dense all-reduce's wire at the same number of ranks (a
        # ring all-reduce sends 2(n-1)/n of a bucket, an all-gather n-1 times the parts);
        # before any transfer ended, or alone (nothing crosses a wire), the codec's own
        # count against the dense buckets'
        on_wire = self.dense_wire_bytes > 0
        sent = self.sent_bytes if on_wire else st.wire_bytes
        dense = self.dense_wire_bytes if on_wire else st.dense_bytes
        ratio = dense / sent if sent else float("inf")
        where = "on its links" if on_wire else "encoded (no link bytes counted)"
        own = _dtype_names(self.codec.dtypes.values())
        values = _dtype_names(self.codec.wire_dtypes.values())
        ef = "with error feedback" if c.error_feedback else "without error feedback"
        if self.codec.corrected:
            masking = "with" if c.factor_masking else "without"
            ef += (f" and DGC momentum correction (m={self.codec.momentum:g}, {masking} "
                   f"factor masking; the optimizer's own momentum is cancelled)")
        if st.elements == 0:  # state.report() before the first backward: the codec, unused
            text = (f"{method}, {c.dtype} values, {ef}: nothing sent yet (no gradient bucket "
                    f"encoded); {fusion}, {overlap}")
            return [ReportRow("gradcomm", text, {"buckets": len(self.bucket_names)})]
        residual = sum(float(r.abs().sum()) for r in self.codec.residual.values())
        text = (f"{method}, {values} values, {ef}: sent {st.sent_elements / st.elements:.2%} "
                f"of gradient elements, {format_bytes(sent / iters)}/iteration from rank "
                f"{run.rank} {where} ({_bytes_vs_dense(ratio, own)}); {fusion}, {overlap}")
        if st.sent_elements == 0:  # a threshold above every gradient: nothing was trained
            text = (f"{method}, {ef}: sent NO gradient element in {iters} iteration(s): the "
                    "threshold is above every gradient, so the exchange moved no weight; "
                    "lower plugins.gradcomm.threshold")
        metrics: dict[str, float | int | str] = {
            "sent_fraction": round(st.sent_elements / st.elements, 6),
            "encoded_bytes_per_iteration": st.wire_bytes // iters,
            "dense_bytes_per_iteration": st.dense_bytes // iters,
            "compression_ratio": round(ratio, 3), "residual_l1": residual,
            "buckets": len(self.bucket_names),
            "momentum_correction": self.codec.momentum if self.codec.corrected else 0.0,
            # every rank sparsifies its own gradients: its row says whose figures they are
            "rank": run.rank,
        }
        if on_wire:
            metrics["wire_bytes_per_iteration"] = sent // iters
            metrics["dense_wire_bytes_per_iteration"] = self.dense_wire_bytes // iters
        return [ReportRow("gradcomm", text, metrics)]


def _shown(value: object, key: str = "") -> str:
    """An option's value in a message: a float as the user would write it, a bucket size as
    it was set (``bucket_mb=0.001`` is kept as 1048 bytes, 0.00099945 MiB, and was shown
    "0.0009995", a number the user never typed)."""
    if key == "bucket_mb" and isinstance(value, float):
        return _mib(value)
    return f"{value:.4g}" if isinstance(value, float) else repr(value)


def _job_optimizers(run_config: Any) -> list[tuple[str, float]]:
    """(optimizer, momentum) of every job the run config names (``workload.jobs``, with the
    core's defaults): what configure can check before any job is built."""
    from omegaconf import OmegaConf

    from accelopt.config import JobConfig

    jobs = OmegaConf.select(run_config, "workload.jobs") if run_config is not None else None
    defaults = JobConfig()
    return [(str(job.get("optimizer", defaults.optimizer)),
             float(job.get("momentum", defaults.momentum))) for job in jobs or []]


SHORT_DTYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16",
                torch.bfloat16: "bf16"}


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    """The gradients' own dtypes, as a lossless bucket goes on the wire ('fp32', 'fp32 and
    fp64'); 'fp32' before any bucket was seen (the configured wire dtype)."""
    names = sorted({SHORT_DTYPES.get(d, str(d).removeprefix("torch.")) for d in dtypes})
    return " and ".join(names) or "fp32"


def _mib(mb: float) -> str:
    """A bucket size in MiB with the fewest digits that give its bytes back: the bytes are
    ``int(bucket_mb * 2**20)``, so ``bucket_mb=0.01`` (10485 bytes) read back as 0.00999928
    MiB; printed here as 0.01, as it was set."""
    if not math.isfinite(mb):
        return f"{mb:g}"
    n = int(mb * 2**20)
    for decimals in range(13):
        text = f"{mb:.{decimals}f}"
        if int(float(text) * 2**20) == n:
            return text
    return f"{mb:g}"


def _bytes_vs_dense(ratio: float, dense: str = "fp32") -> str:
    """'4.0x fewer bytes than fp32', or, where the encoding costs more than it saves (a
    threshold that sends most elements, each with its index), '1.9x more bytes than fp32':
    a ratio below 1 read as 'fewer' would claim a saving that did not happen. ``dense``
    names the gradients' own dtypes, what DDP's plain all-reduce sends: a bf16 model's fp16
    bucket is no saving (it read '2.0x fewer bytes than fp32')."""
    if f"{ratio:.1f}" == "1.0":
        return f"as many bytes as {dense}: no saving"
    if ratio >= 1:
        return f"{ratio:.1f}x fewer bytes than {dense}" if ratio != float("inf") else "no bytes"
    return f"{1 / ratio:.1f}x more bytes than {dense}: the encoding costs more than it saves"
