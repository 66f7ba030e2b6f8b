"""The communication hook that carries PyTorch DDP's gradient buckets through the transport
(and so through every transfer hook: filter, encode, order, decode, done).

DDP decides *when* gradients are ready and groups them into its own buckets, which change
once after the first iteration (DDP starts with a single bucket and rebuilds them in the
order gradients arrived). The transfers plugins see must not change with that: they are the
job's *logical* buckets (``JobInfo.buckets``: the parameters that require grad, as DDP's,
in backward order, each closed once it holds ``cluster.bucket_mb``, a bucket per dtype: the
rule DDP applies when it rebuilds; a frozen parameter is never sent), named ``bucket0``,
``bucket1``, … in every iteration, so a codec's per-bucket state (error-feedback residuals)
keeps its shape. When a DDP bucket holds exactly one logical bucket, in the same order (the
common case once DDP has rebuilt), its flat buffer is sent as it is, with no copy, as DDP's
built-in hook does (straight to the all-reduce when no transfer hook and no order stand in
between: ``Transport.allreduce_direct``), and its decoded sum is handed back to DDP, which
copies it into the gradients. Otherwise the DDP bucket is cut into the logical buckets'
parts, each logical bucket is sent once all its parts have arrived (possibly from several
DDP buckets), and the results are written back into DDP's buffers.

Each rank scales its gradients by its share of the global batch's loss before sending
(``weight``, which the runtime sets per iteration: its rows' share, or its labelled positions'
where the model's loss is a mean over them; ``1 / world`` in a user's own DDP script), so the
sum is the global batch's mean gradient. A rank of weight 0 sends zeros (its gradient may be
nan: a mean over no labelled position).

One instance per job and rank. ``begin(iteration)`` plans an iteration's transfers (the order
hook is asked then); the runtime calls it from the job's exchange, and a user's DDP script,
which has no such call, gets it from the first bucket of each iteration (DDP's bucket of
``index() == 0`` that is not part of the current one: with ``static_graph=True`` every
bucket of DDP's first iteration has index 0, see :meth:`BucketHook._starts_iteration`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from accelopt.drivers.cluster.transport import ALL_RANKS, Transport
from accelopt.errors import UserError
from accelopt.job.job import STATE_LOAD, STATE_SAVE
from accelopt.types import ParamInfo, ReportRow, RunInfo, TransferRecord


@dataclass(frozen=True)
class _Piece:
    """One parameter's gradient inside a DDP bucket: where it is in DDP's flat buffer and
    which logical bucket (and position in it) it belongs to."""

    bucket: int
    position: int
    offset: int
    numel: int


@dataclass(frozen=True)
class _Plan:
    """How one DDP bucket (identified by its parameters) maps onto the logical buckets."""

    pieces: tuple[_Piece, ...]
    touched: tuple[int, ...]
    exact: int | None
    """The logical bucket this DDP bucket *is* (same parameters, same order), else ``None``."""


class BucketHook:
    """The state of :func:`reduce_bucket` (``ddp.register_comm_hook(state, reduce_bucket)``)."""

    def __init__(self, transport: Transport, *, job_id: str, table: Sequence[ParamInfo],
                 buckets: Sequence[Sequence[int]], model: nn.Module, weight: float,
                 self_planning: bool = False) -> None:
        self.transport = transport
        self.job_id = job_id
        self.weight = weight
        self.self_planning = self_planning
        """A user's DDP script: plan each iteration at its first bucket (nobody calls
        :meth:`begin`)."""
        params = dict(model.named_parameters())
        self.logical = [[table[i] for i in bucket] for bucket in buckets]
        self._where = {id(params[p.name]): (b, k)
                       for b, bucket in enumerate(self.logical) for k, p in enumerate(bucket)}
        self._sizes = [[slot_size(params[p.name]) for p in bucket]
                       for bucket in self.logical]
        self._starts = [[sum(sizes[:k]) for k in range(len(sizes))] for sizes in self._sizes]
        """Where each parameter starts in its logical bucket's flat gradient."""
        self._names = {id(p): name for name, p in params.items()}
        self._plans: dict[tuple[int, ...], _Plan] = {}
        self.iteration = -1
        self._futures: list[torch.futures.Future] = []
        self._parts: dict[int, dict[int, torch.Tensor]] = {}
        self._sent: set[int] = set()
        """The logical buckets of this iteration handed to the transport."""
        self.in_place = 0
        """DDP buckets sent as they are (one logical bucket, same order: no copy)."""
        self.direct = 0
        """Of those, buckets whose all-reduce started at once (no transfer hook, no order:
        :meth:`Transport.allreduce_direct`)."""
        self.cut = 0
        """DDP buckets cut into logical buckets' parts (DDP's first iteration, or gradients
        arriving out of layer order)."""
        self.closed = False
        """:meth:`close` was called: the transport's completion thread is gone, so a bucket
        posted now would never complete (backward hung forever, whatever ``timeout_s``)."""
        self.run: RunInfo | None = None
        """The record the plugins were started with (a user's DDP script; for :meth:`report`)."""
        self.on_last_bucket: Callable[[], None] | None = None
        """Called when DDP hands over an iteration's last bucket: every gradient is computed,
        and what is left of ``backward()`` is DDP waiting for the reductions (the runtime's
        timeline counts it as a wait, not as compute)."""

    # -- records and planning ----------------------------------------------------------

    def record(self, b: int, iteration: int) -> TransferRecord:
        bucket = self.logical[b]
        return TransferRecord(
            job_id=self.job_id, iteration=iteration, source=self.transport.rank,
            destination=ALL_RANKS, tensor=f"bucket{b}", nbytes=sum(p.nbytes for p in bucket),
            layer_index=min(p.layer_index for p in bucket), kind="grad",
        )

    def begin(self, iteration: int) -> None:
        """Plan ``iteration``'s transfers: one per logical bucket, every iteration."""
        self.iteration = iteration
        self._futures = [torch.futures.Future() for _ in self.logical]
        self._parts = {}
        self._sent = set()
        self.transport.plan(iteration, ALL_RANKS,
                            [self.record(b, iteration) for b in range(len(self.logical))])

    def _plan(self, params: Sequence[torch.Tensor]) -> _Plan:
        pieces, offset = [], 0
        for p in params:
            where = self._where.get(id(p))
            if where is None and id(p) in self._names:
                raise UserError(
                    f"DDP reduces parameter '{self._names[id(p)]}', which did not require "
                    "grad when this hook was made, so its logical buckets leave it out: "
                    "freeze or unfreeze parameters before wrapping the model in DDP, and "
                    "make the hook after that")
            if where is None:
                raise UserError("DDP holds a parameter that this hook was not made for: pass "
                                "comm_hook the very module this DDP wraps (ddp.module), make "
                                "one (state, hook) per DDP model, and do not change the model "
                                "after wrapping it")
            size = slot_size(p)
            pieces.append(_Piece(where[0], where[1], offset, size))
            offset += size
        touched = tuple(dict.fromkeys(piece.bucket for piece in pieces))
        exact = None
        if len(touched) == 1:
            b = touched[0]
            if [piece.position for piece in pieces] == list(range(len(self.logical[b]))):
                exact = b
        return _Plan(tuple(pieces), touched, exact)

    # -- the hook ----------------------------------------------------------------------

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.closed:
            raise UserError(CLOSED)
        buffer = bucket.buffer()
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(params)
        if self.self_planning and bucket.index() == 0 and self._starts_iteration(plan):
            if self.iteration >= 0:
                self.transport.finish_allreduce(self.iteration)
                self._forget()
            self.begin(self.iteration + 1)
        if plan.exact is not None:
            b = plan.exact
            self._sent.add(b)
            self.in_place += 1
            self._weighted(buffer)
            direct = self.transport.allreduce_direct(self.record(b, self.iteration), buffer)
            if direct is not None:
                self.direct += 1
                out = direct
            else:
                self._post(b, buffer)
                out = self._futures[b].then(lambda f: _into(buffer, f.value(), b))
        else:
            self.cut += 1
            for piece in plan.pieces:
                parts = self._parts.setdefault(piece.bucket, {})
                parts[piece.position] = buffer[piece.offset:piece.offset + piece.numel]
                if len(parts) == len(self.logical[piece.bucket]):
                    self._sent.add(piece.bucket)
                    self._post(piece.bucket, self._weighted(self._gather(piece.bucket, parts)))
            touched = [self._futures[b] for b in plan.touched]
            out = torch.futures.collect_all(touched).then(
                lambda _f: self._scatter(plan, buffer))
        if bucket.is_last() and self.on_last_bucket is not None:
            self.on_last_bucket()
        if bucket.is_last() or len(self._sent) == len(self.logical):
            # every bucket of the iteration is posted: a transfer still held by the order
            # hook waits for a tensor that never comes; say so instead of hanging backward.
            # (Also without is_last(): DDP with static_graph=True flags no bucket of its
            # first iteration as the last one.)
            self.transport.wait_started(self.iteration)
        return out

    def _starts_iteration(self, plan: _Plan) -> bool:
        """Whether a DDP bucket of ``index() == 0`` begins a new iteration (a user's script,
        where nobody calls :meth:`begin`). Not always: DDP with ``static_graph=True`` hands
        over *every* bucket of its first iteration with ``index() == 0`` (and none with
        ``is_last()``), and a model with parameters of several dtypes has several buckets
        then; reading each as a new iteration finished the iteration with a planned
        transfer still to come, which waited for the order timeout. A new iteration begins
        when every logical bucket of the current one has been sent, or when this DDP bucket
        holds a gradient the current iteration has already taken (DDP hands each gradient
        over once per iteration). Nothing planned yet (a new hook, or one given a saved
        state's iteration count) begins one too."""
        if not self._futures or len(self._sent) == len(self.logical):
            return True
        return any(piece.bucket in self._sent
                   or piece.position in self._parts.get(piece.bucket, ())
                   for piece in plan.pieces)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed script needs to continue as the uninterrupted one would: each
        plugin's own state (``accelopt_state_save``, by plugin name: gradcomm's
        error-feedback residuals and DGC velocities) and the iteration count. Save it with
        the model and the optimizer on every rank (each rank's residuals are its own)."""
        job = self.run.job if self.run is not None else None
        # None (nothing to carry yet) is kept: a load then knows that the plugin's state was
        # saved, not left out
        plugins = {name: self.transport.host.call_one(name, STATE_SAVE, job=job)
                   for name in self._carrying()}
        return {"iteration": self.iteration, "plugins": plugins}

    def _carrying(self) -> list[str]:
        """The plugins whose state :meth:`state_dict` saves (those with a save hook, in a
        user's script: a hook started with a job)."""
        if self.run is None or self.run.job is None:
            return []
        host = self.transport.host
        return [name for name in host.names if STATE_SAVE in host.hooks_of(name)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a hook made for the same model and plugins,
        before the first backward. Anything else is refused in one line, as it would be
        dropped silently: what is not such a state (the whole checkpoint instead of its
        hook entry: the residuals were lost and the iteration count reset, and the resume
        diverged), a plugin state this hook has no plugin to load, or a state without one
        of this hook's plugins that carry state."""
        refuse_foreign_state(state)
        host = self.transport.host
        saved = state["plugins"]
        for name in saved:
            if STATE_LOAD not in host.hooks_of(name):
                raise UserError(f"the saved hook state holds the state of plugin '{name}', "
                                f"and this hook has no plugin '{name}' that can load it; make "
                                "the hook with the same plugins and options as the saved one")
        for name in self._carrying():
            if name not in saved:
                raise UserError(f"the saved hook state holds no state of plugin '{name}' "
                                f"(it holds {_listed(saved) or 'none'}), which this hook "
                                "carries across a checkpoint; pass what state_dict() of a hook "
                                "made with the same plugins and options returned")
        job = self.run.job if self.run is not None else None
        for name, plugin_state in saved.items():
            if plugin_state is not None:
                host.call_one(name, STATE_LOAD, job=job, state=plugin_state)
        self.iteration = state["iteration"]
        self._futures = []  # the next bucket of index 0 begins the next iteration

    def unsent(self, params: dict[str, torch.Tensor]) -> list[str] | None:
        """After backward: ``None`` when DDP handed over every bucket of the iteration, else
        the trainable parameters of the buckets it did not (the ones without a gradient
        first). DDP without ``find_unused_parameters`` never hands over a bucket holding a
        parameter the loss did not reach, and the iteration would wait for it until the
        transport's timeout."""
        missing = [b for b in range(len(self.logical)) if b not in self._sent]
        if not missing:
            return None
        names = [p.name for b in missing for p in self.logical[b]]
        return [n for n in names if params[n].grad is None] or names

    def _forget(self) -> None:
        """A user's script may train for days: keep the counters, not a record per bucket."""
        stats = self.transport.stats
        self.transport.spans.clear()
        stats.started_log.clear()
        stats.bytes_by_iteration.clear()

    def report(self) -> list[ReportRow]:
        """The plugins' summary rows so far (``accelopt_report_rows``), e.g. gradcomm's
        bytes sent and compression ratio."""
        if self.run is None:
            return []
        answers = self.transport.host.call("accelopt_report_rows", run=self.run)
        return [row for rows in answers or [] for row in (rows or [])]

    def close(self) -> None:
        """Stop the transport's completion thread (call it before
        ``dist.destroy_process_group()``; an accelopt run does). The hook refuses every
        bucket after it, in one line: a bucket's transfer would never complete."""
        self.closed = True
        self.transport.close()

    def _weighted(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` scaled in place by this rank's weight; zeros for a weight of 0, which
        contributes nothing even where the gradient is nan (``0 * nan`` is nan)."""
        return flat.zero_() if self.weight == 0 else flat.mul_(self.weight)

    def _post(self, b: int, payload: torch.Tensor) -> None:
        self.transport.post(self.record(b, self.iteration), payload, future=self._futures[b])

    def _gather(self, b: int, parts: dict[int, torch.Tensor]) -> torch.Tensor:
        """The logical bucket's flat gradient, in its own order (a copy)."""
        return torch.cat([parts[k] for k in range(len(self.logical[b]))])

    def _scatter(self, plan: _Plan, buffer: torch.Tensor) -> torch.Tensor:
        starts = self._starts
        results = {b: _flat(self._futures[b].value(), sum(self._sizes[b]), b)
                   for b in plan.touched}
        for piece in plan.pieces:
            start = starts[piece.bucket][piece.position]
            buffer[piece.offset:piece.offset + piece.numel].copy_(
                results[piece.bucket][start:start + piece.numel])
        return buffer


CLOSED = ("this DDP communication hook was closed (state.close()), and a closed hook cannot "
          "reduce gradients: do not train after close(); to train on, make a new "
          "(state, hook) with comm_hook and register it on a new DDP")


STATE_KEYS = frozenset({"iteration", "plugins"})
"""The keys of :meth:`BucketHook.state_dict`."""


def refuse_foreign_state(state: object) -> None:
    """Refuse in one line what is not a :meth:`BucketHook.state_dict`: a dict with exactly
    its keys, an iteration count (-1: none yet) and the plugins' states by name. Read
    leniently, the whole checkpoint (``{"model", "optimizer", "hook"}``) loaded as nothing:
    no residuals, the iteration count reset, a resume that diverged without an error."""
    fix = ("pass what state.state_dict() returned, e.g. load_state_dict(checkpoint['hook']) "
           "rather than the whole checkpoint")
    if not isinstance(state, dict):
        raise UserError(f"load_state_dict was given a {type(state).__name__}, not a hook "
                        f"state; {fix}")
    if set(state) != STATE_KEYS:
        raise UserError(f"load_state_dict was given a dict with keys {_listed(state) or 'none'}"
                        f", not a hook state (keys 'iteration' and 'plugins'); {fix}")
    iteration, plugins = state["iteration"], state["plugins"]
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < -1:
        raise UserError(f"load_state_dict: the hook state's iteration must be an int >= -1, "
                        f"got {iteration!r}; {fix}")
    if not isinstance(plugins, dict) or not all(isinstance(k, str) for k in plugins):
        raise UserError("load_state_dict: the hook state's plugins must be a dict of plugin "
                        f"states by name, got {type(plugins).__name__}; {fix}")


def _listed(keys: object) -> str:
    """A dict's keys for a message: 'model', 'opt', 'hook' (the first eight)."""
    names = [repr(k) for k in keys][:9]  # type: ignore[attr-defined]
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def slot_size(param: torch.Tensor) -> int:
    """How many elements ``param``'s gradient takes in a DDP bucket: DDP lays a complex
    gradient into a bucket of its real dtype as (real, imaginary) pairs
    (``torch.view_as_real``), two elements per complex one."""
    return param.numel() * 2 if param.is_complex() else param.numel()


def reduce_bucket(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's communication hook: ``ddp.register_comm_hook(state, reduce_bucket)`` with a
    :class:`BucketHook` as the state; returns the ``Future`` of the bucket's reduced buffer.
    (No annotations: DDP checks them as objects, and this module's are strings.)"""
    return state(bucket)


def _flat(value: object, numel: int, b: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != numel:
        got = (f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        raise RuntimeError(f"bucket{b}: accelopt_transfer_decode must give back the summed "
                           f"bucket ({numel} elements), got {got}")
    return value.reshape(-1)


def _into(buffer: torch.Tensor, value: object, b: int) -> torch.Tensor:
    """The decoded, summed bucket for DDP. DDP copies whatever tensor the hook's future
    yields into the gradients (it re-points its bucket views at it), so a decoded tensor of
    the buffer's dtype and device is handed over as it is, with no copy into the buffer; any
    other is cast into the buffer (DDP's own fp16 hook does that copy)."""
    if value is buffer:
        return buffer
    flat = _flat(value, buffer.numel(), b)
    if flat.dtype == buffer.dtype and flat.device == buffer.device and flat.is_contiguous():
        return flat
    buffer.copy_(flat)
    return buffer
