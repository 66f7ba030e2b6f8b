"""Parameter-server mode: synchronous SGD with parameters sharded over the servers, as the
two exchanges a job's step uses on a server and on a worker.

Per iteration: every server posts each of its parameter tensors to each worker as its own
transfer (``begin``); a worker starts forward as soon as the parameters of the first layer
have arrived (a forward pre-hook per layer, installed once in ``attach``, waits for that
layer only; parameters that forward reads outside their module's forward are waited for
before forward begins: :class:`ForwardReads`); each gradient is posted to its server the moment autograd has accumulated it;
the servers average the workers' gradients (weighted by shard size, so the result is the
gradient of the whole global batch: ``gradients``; where the model's loss is a mean over
labelled positions, each worker first rescales its gradient to its positions' share:
``PsWorker.weigh``), and the job's step then runs
``accelopt_before_optimizer_step`` and the optimizer on the server's shard.

Early update (cross-iteration scheduling: an order hook answered
:class:`~accelopt.types.TransferPriorities` with ``early_update``). The server updates each
tensor the moment every worker's gradient for it is in, and posts it for the next iteration
at once, by priority, so the next forward's first layers can be on their way while this
iteration's last gradients still are. A worker therefore receives iteration i+1's
parameters while it may still run iteration i's backward: it posts those receives when
iteration i begins and stages what arrives until i+1 begins (autograd still needs the
values forward used). The arithmetic is that of one optimizer step over the shard: torch's
SGD, Adam and AdamW update tensor by tensor; the job refuses the per-tensor update (and the
server keeps the whole step, logging why) wherever a step reads more than one tensor.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from accelopt.drivers.cluster import threads
from accelopt.drivers.cluster.settings import ClusterSettings
from accelopt.drivers.cluster.transport import CommunicationError, Transport
from accelopt.job import Exchange
from accelopt.job.params import (
    alias_layer_modules,
    layer_modules,
    shard_by_bytes,
    shard_rows,
    tied_aliases,
)
from accelopt.types import ParamInfo, Role, TransferRecord

if TYPE_CHECKING:
    from accelopt.job import Job
    from accelopt.job.timeline import PhaseTimer

log = logging.getLogger(__name__)


class Receivers:
    """Receiving threads of one iteration (reused threads: :mod:`.threads`); the first error
    is re-raised on join."""

    def __init__(self, on_error: Callable[[BaseException | None], None] | None = None) -> None:
        self.tasks: list[threads.Task] = []
        self.error: BaseException | None = None
        self.on_error = on_error

    def start(self, fn: Callable[..., None], *args: Any) -> None:
        def body() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - surfaced in join()
                if self.error is None:
                    self.error = exc
                if self.on_error is not None:
                    self.on_error(self.error)

        self.tasks.append(threads.start(body, name="accelopt-receive"))

    def join(self) -> None:
        for task in self.tasks:
            task.join()
        if self.error is not None:
            raise self.error


class ClusterExchange(Exchange):
    """What the PS and all-reduce exchanges share: the rank, the settings, the transport and
    the records of the job's transfers."""

    moves = True

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport) -> None:
        self.settings = settings
        self.rank = rank
        self.transport = transport
        self.role: Role = settings.role(rank)  # type: ignore[assignment]
        self.job_id = ""
        self.table: tuple[ParamInfo, ...] = ()

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        self.job_id = job.info.job_id
        self.table = job.info.parameters
        self.transport.tensor_ids = {p.name: p.index for p in self.table}

    def record(self, info: ParamInfo, iteration: int, source: int, destination: int,
               kind: str) -> TransferRecord:
        return TransferRecord(
            job_id=self.job_id, iteration=iteration, source=source, destination=destination,
            tensor=info.name, nbytes=info.nbytes, layer_index=info.layer_index,
            kind=kind,  # type: ignore[arg-type]
        )

    def shards(self) -> dict[int, list[ParamInfo]]:
        servers = self.settings.server_ranks()
        return dict(zip(servers, shard_by_bytes(self.table, len(servers)), strict=True))

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(parameters, buffers) this rank reports at the end (what it is the owner of)."""
        return {}, {}

    def close(self) -> None:
        self.transport.close()


class PsServer(ClusterExchange):
    """A parameter server: sends its shard, averages the workers' gradients into it; the job's
    optimizer updates the shard."""

    computes = False
    steps = True
    whole = False

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport,
                 servers_group: Any = None) -> None:
        super().__init__(settings, rank, transport)
        self.servers_group = servers_group
        self.whole = settings.servers == 1
        workers = settings.worker_ranks()
        self.workers = workers
        self._grads: dict[int, dict[str, torch.Tensor | None]] = {}
        self._receivers: Receivers | None = None
        self._early = False
        """This iteration updates tensor by tensor and posts the next iteration's at once."""
        self._posted_for = -1
        """The iteration whose parameters are already posted (early update)."""
        self._ready: queue.Queue[str | BaseException] = queue.Queue()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._refused = ""

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        super().attach(job, timer)
        self.shard = self.shards()[self.rank]
        self.params = dict(job.model.named_parameters())
        self.total = job.info.iterations
        self._job = job
        batch = job.info.batch_size
        self.weights = {w: (stop - start) / batch for w, (start, stop) in
                        zip(self.workers, shard_rows(batch, len(self.workers)), strict=True)}

    def rows(self, batch_size: int) -> tuple[int, int]:
        return shard_rows(batch_size, self.settings.workers)[0]  # worker 0's (job_built)

    def stepped_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        params = dict(model.named_parameters())
        return {p.name: params[p.name] for p in self.shards()[self.rank]}

    def begin(self, iteration: int) -> None:
        t = self.transport
        self._grads = {w: {} for w in self.workers}
        self._counts, self._ready = Counter(), queue.Queue()
        if self._posted_for != iteration:  # else posted during the previous iteration
            # (no gradient can come before its parameters have gone: posting first is safe)
            self._early = self._post_params(iteration, now=True)
        workers, early = len(self.workers), self._early
        receivers = Receivers(on_error=self._ready.put)
        for w in self.workers:
            records = {p.index: self.record(p, iteration, w, self.rank, "grad") for p in self.shard}

            def deliver(rec: TransferRecord, payload: Any, got: dict = self._grads[w]) -> None:
                got[rec.tensor] = payload
                if not early:  # the whole step joins the receivers; nothing to count
                    return
                with self._lock:
                    self._counts[rec.tensor] += 1
                    if self._counts[rec.tensor] == workers:
                        self._ready.put(rec.tensor)  # every worker's gradient is in

            receivers.start(t.receive, iteration, w, records, deliver)
        self._receivers = receivers

    def _post_params(self, iteration: int, now: bool) -> bool:
        """Plan the shard's transfers of ``iteration`` to every worker and, if ``now``,
        post them; whether the order hook asked for early update. An early-updating server
        sends copies: a worker whose loss does not reach a tensor returns its (zero)
        gradient before it has the tensor, so the update could change it mid-send."""
        t, early = self.transport, True
        records = {w: [self.record(p, iteration, self.rank, w, "param") for p in self.shard]
                   for w in self.workers}
        for w in self.workers:
            schedule = t.plan(iteration, w, records[w])
            early = early and schedule is not None and schedule.early_update
        self._posted_for = iteration
        if now:
            values = [self.params[p.name].detach() for p in self.shard]
            if early:
                values = [v.clone() for v in values]
            for w in self.workers:
                for rec, value in zip(records[w], values, strict=True):
                    t.post(rec, value)
        return early

    def _average(self, info: ParamInfo) -> None:
        """``.grad`` of one tensor := the workers' gradients weighted by their rows (a worker
        without one counts as zero; with none at all, ``None``)."""
        param = self.params[info.name]
        total = None
        for w in self.workers:
            g = self._grads[w].get(info.name)
            if g is not None:
                if total is None:
                    total = torch.zeros_like(param)
                total.add_(g.to(total.device), alpha=self.weights[w])
        param.grad = total  # None when no worker's loss reached it: the step skips it

    def gradients(self, iteration: int,
                  update: Callable[[Sequence[str]], None] | None = None) -> bool:
        t = self.transport
        if self._early and update is None and not self._refused:
            self._refused = self._job.whole_step_reason or "the job takes no step"
            log.warning("rank %d, job %s: early update refused (%s): the whole optimizer step "
                        "instead", self.rank, self.job_id, self._refused)
        if self._early and update is not None:
            return self._update_early(iteration, update)
        t.wait_started(iteration)
        assert self._receivers is not None
        self._receivers.join()
        t.complete(iteration)  # the parameters left: the optimizer may change them now
        with torch.no_grad():
            for p in self.shard:
                self._average(p)
        return False

    def _update_early(self, iteration: int,
                      update: Callable[[Sequence[str]], None]) -> bool:
        """Update the tensors as their gradients complete; post them for the next iteration.
        Whatever has completed together is updated in one optimizer step (a model of many
        small tensors would otherwise pay the step's fixed cost per tensor), then posted
        first-layer first."""
        t = self.transport
        following = iteration + 1
        posting = following < self.total
        early_next = self._post_params(following, now=False) if posting else False
        by_name = {p.name: p for p in self.shard}
        left = len(self.shard)
        while left:
            ready = self._take_ready(iteration)
            infos = sorted((by_name[n] for n in ready), key=lambda p: p.index)
            with torch.no_grad():
                for info in infos:
                    self._average(info)
            update([info.name for info in infos])
            # a tensor without a gradient (frozen, or the loss never reached it) the step
            # skipped: not an update
            t.stats.updated_early += sum(self.params[info.name].grad is not None
                                         for info in infos)
            left -= len(infos)
            if posting:
                for info in infos:
                    value = self.params[info.name].detach().clone()  # the next step changes it
                    for w in self.workers:
                        t.post(self.record(info, following, self.rank, w, "param"), value)
        assert self._receivers is not None
        self._receivers.join()
        t.complete(iteration)
        self._early = early_next
        return True

    def _take_ready(self, iteration: int) -> list[str]:
        """The next tensor whose gradients are all in (waiting for it), and every other one
        that is already complete."""
        deadline = self.settings.timeout_s
        try:
            names = [self._ready.get(timeout=deadline)]
        except queue.Empty:
            raise CommunicationError(
                f"rank {self.rank}: the workers' gradients did not all arrive within "
                f"{deadline:g} s at iteration {iteration}") from None
        while True:
            try:
                names.append(self._ready.get_nowait())
            except queue.Empty:
                break
        for name in names:
            if isinstance(name, BaseException):
                raise name
        return names  # type: ignore[return-value]

    def reduce(self, value: float, op: str) -> float:
        if self.settings.servers == 1:
            return value
        box = torch.tensor([value], dtype=torch.float64, device=self.transport.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=self.servers_group)
        return float(box.item())

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """This shard's parameters, a tied one under each of its names (so the gathered
        state loads into the model like its own ``state_dict()``)."""
        state = {p.name: self.params[p.name].detach().cpu().clone() for p in self.shard}
        state.update({alias: state[canonical] for alias, canonical in tied_aliases(model).items()
                      if canonical in state})
        return state, {}


class LayerArrivals:
    """Which layers' parameters have arrived in the current iteration (a forward pre-hook
    per layer waits on it, so forward starts as soon as its first layer is in)."""

    def __init__(self, counts: Counter[int], timeout_s: float) -> None:
        self.counts = counts
        self.timeout_s = timeout_s
        self.arrived: Counter[int] = Counter()
        self.early: dict[int, Counter[int]] = {}
        """Arrivals for iterations that have not begun yet (early update's next iteration)."""
        self.iteration = -1
        self.cv = threading.Condition()
        self.error: BaseException | None = None

    def reset(self, iteration: int) -> None:
        with self.cv:
            self.iteration, self.error = iteration, None
            self.arrived = self.early.pop(iteration, Counter())
            self.early = {i: c for i, c in self.early.items() if i > iteration}

    def arrive(self, layer: int, iteration: int | None = None) -> None:
        with self.cv:
            if iteration is None or iteration == self.iteration:
                self.arrived[layer] += 1
            else:
                self.early.setdefault(iteration, Counter())[layer] += 1
            self.cv.notify_all()

    def fail(self, error: BaseException | None) -> None:
        with self.cv:
            self.error = error or CommunicationError("a receiving thread failed")
            self.cv.notify_all()

    def ready(self, layer: int) -> bool:
        return self.arrived[layer] >= self.counts[layer]

    def wait(self, layer: int) -> None:
        with self.cv:
            ok = self.cv.wait_for(lambda: self.error is not None or self.ready(layer),
                                  timeout=self.timeout_s)
            if self.error is not None:
                raise self.error
            if not ok:
                raise CommunicationError(
                    f"parameters of layer {layer} did not arrive within {self.timeout_s:g} s "
                    f"at iteration {self.iteration}"
                )


class FirstReads(TorchFunctionMode):
    """Sees every torch call of a worker's first forward: before a call whose arguments hold
    one of the job's parameters runs, ``on_read(layer)`` is told that parameter's layer
    (:class:`ForwardReads`). Thread-local, as torch's function modes are: the receiving
    threads' copies into the parameters do not pass through it."""

    def __init__(self, layer_of: dict[int, int], on_read: Callable[[int], None]) -> None:
        super().__init__()
        self.layer_of = layer_of
        self.on_read = on_read

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            layer = self.layer_of.get(id(leaf))
            if layer is not None:
                self.on_read(layer)
        return func(*args, **kwargs)


class ForwardReads:
    """Which layers a worker's forward reads without a pre-hook having waited for them, and
    the wait for those layers before forward from then on.

    Why: the per-layer pre-hooks wait for a layer when its module's forward runs, and the
    receiving threads copy each parameter in the moment it arrives. A model that uses a
    parameter without calling its module's forward (``F.linear(x, self.a.weight)``), or
    before calling it, would read last iteration's values, or have them replaced while
    autograd still holds them (torch's "modified by an inplace operation").

    How: the first forward of the job on this worker runs under :class:`FirstReads`; a read
    of a layer no pre-hook has waited for yet in that forward waits for the layer there and
    then (so that forward reads the new values too) and marks it *unhooked*, as is every
    layer no pre-hook waited for at all. From the next forward on, a pre-hook on the root
    module waits for the unhooked layers before forward begins (no function mode, no cost
    per call); every other layer keeps its own pre-hook, so an ordinary model (every
    parameter read inside its module's forward) keeps the per-layer overlap. Once a layer
    has arrived nothing is copied into it until the next iteration begins (the next
    iteration's values are staged), so no copy lands while forward or backward uses it.
    Forward's control flow is assumed to read the same parameters every iteration."""

    def __init__(self, layers: Sequence[int], layer_of: dict[int, int],
                 wait: Callable[[Sequence[int], str], None]) -> None:
        self.layers = tuple(layers)
        self.wait = wait
        self.unhooked: tuple[int, ...] | None = None
        """``None`` until the first forward has ended."""
        self.covered: set[int] = set()
        """Layers waited for so far in the first forward (by a pre-hook or a read)."""
        self.early: set[int] = set()
        """Layers the first forward read before any pre-hook had waited for them."""
        self.mode = FirstReads(layer_of, self._read)
        self.depth = 0

    def hooked(self, layers: Sequence[int]) -> None:
        """A pre-hook has waited for ``layers`` (they have arrived)."""
        if self.unhooked is None:
            self.covered.update(layers)

    def _read(self, layer: int) -> None:
        if layer not in self.covered:
            self.wait([layer], f"wait layer {layer} (read outside its module)")
            self.early.add(layer)
            self.covered.add(layer)

    def before(self, _module: nn.Module, _args: Any) -> None:
        """The root's forward pre-hook."""
        if self.unhooked is None:
            if self.depth == 0:
                self.mode.__enter__()
            self.depth += 1
        elif self.unhooked:
            self.wait(self.unhooked, "wait unhooked layers")

    def after(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        """The root's forward hook (also called when forward raised)."""
        if self.unhooked is not None or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            self.mode.__exit__(None, None, None)
            missed = self.early | (set(self.layers) - self.covered)
            self.unhooked = tuple(sorted(missed))
            if missed:
                log.debug("forward reads layers %s outside their modules: waited for before "
                          "forward from now on", self.unhooked)


class PsWorker(ClusterExchange):
    """A worker: receives the parameters layer by layer during forward, pushes each gradient
    to its server the moment autograd has it; takes no optimizer step."""

    computes = True
    steps = False

    def __init__(self, settings: ClusterSettings, rank: int, transport: Transport) -> None:
        super().__init__(settings, rank, transport)
        self.index = settings.worker_index(rank)
        self.stream = self.index
        self._iteration = 0
        self._posted: set[str] = set()
        self._receivers: dict[int, Receivers] = {}
        self._staged: dict[int, list[tuple[TransferRecord, Any]]] = {}
        """Parameters of an iteration that has not begun (early update), until it begins."""
        self._begun = -1
        self._stage_lock = threading.Lock()
        self._sending: list[int] = []
        """Iterations whose gradient sends may still be leaving."""
        self._scale = 1.0
        """What this iteration's gradients are multiplied by before they are sent
        (:meth:`weigh`)."""

    def rows(self, batch_size: int) -> tuple[int, int]:
        return shard_rows(batch_size, self.settings.workers)[self.index]

    def stepped_parameters(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return {}

    def attach(self, job: Job, timer: PhaseTimer) -> None:
        super().attach(job, timer)
        model = job.model
        self.model = model
        self.total = job.info.iterations
        start, stop = self.rows(job.info.batch_size)
        self.row_share = (stop - start) / job.info.batch_size
        """This worker's rows over the batch's: the weight the servers give its gradients."""
        self.params = dict(model.named_parameters())
        self._shards = self.shards()
        self.owner = {p.name: s for s, shard in self._shards.items() for p in shard}
        self.layers = LayerArrivals(Counter(p.layer_index for p in self.table),
                                    self.settings.timeout_s)
        # A module's forward may use its submodules' parameters without calling their
        # forward (nn.MultiheadAttention reads out_proj.weight directly), so layer L also
        # waits for the layers below its module; the root module waits only for its own.
        path = {p.layer_index: p.module for p in self.table}
        inside = {layer: sorted(n for n, sub in path.items()
                                if n == layer or (mod and sub.startswith(mod + ".")))
                  for layer, mod in path.items()}
        layers = self.layers

        def wait_for(needed: Sequence[int], label: str) -> None:
            if not all(layers.ready(n) for n in needed):
                timer.wait(label, lambda: [layers.wait(n) for n in needed])

        def wait_layer(layer: int) -> None:
            wait_for(inside[layer], f"wait layer {layer}")
            self.reads.hooked(inside[layer])

        params = {id(self.params[p.name]): p.layer_index for p in self.table}
        self.reads = ForwardReads(sorted(path), params, wait_for)
        model.register_forward_pre_hook(self.reads.before, prepend=True)
        model.register_forward_hook(self.reads.after, always_call=True)

        # per-layer waits, installed once: forward of layer L starts when L's parameters are in
        for layer, module in layer_modules(model, self.table).items():
            module.register_forward_pre_hook(lambda _m, _a, layer=layer: wait_layer(layer))
        # a module holding a tied parameter listed under another module waits for it too
        def wait_tied(layers_: list[int]) -> None:  # a pre-hook returning non-None replaces
            for n in layers_:                        # the module's input
                wait_layer(n)

        modules = dict(model.named_modules())
        for path_, tied in alias_layer_modules(model, self.table).items():
            modules[path_].register_forward_pre_hook(
                lambda _m, _a, tied=sorted(tied): wait_tied(tied))
        for info in self.table:  # a frozen parameter has no gradient to wait for
            if self.params[info.name].requires_grad:
                self.params[info.name].register_post_accumulate_grad_hook(
                    lambda p, info=info: self._post_grad(info, p.grad))

    def weigh(self, share: float | None) -> None:
        """The servers weigh each worker's gradient by its rows' share of the batch; where
        this worker's share of the loss is another (its labelled positions'), its gradient is
        rescaled by the ratio before it is sent, so the servers' weighted sum is the batch's
        mean gradient all the same."""
        self._scale = 1.0 if share is None else share / self.row_share

    def _post_grad(self, info: ParamInfo, grad: torch.Tensor | None) -> None:
        """Send one gradient; ``None`` (the loss did not reach the parameter, or it is
        frozen) goes as a header saying so, and the server leaves that parameter's ``.grad``
        ``None`` unless another worker had one, as one process would (a zero gradient is
        not the same: weight decay and momentum would still move the parameter). A scale of
        0 (no labelled position in this worker's rows) sends zeros: its gradient may be nan
        (a mean over nothing), and ``0 * nan`` is nan."""
        self._posted.add(info.name)
        if grad is not None and self._scale != 1.0:
            with torch.no_grad():  # this worker's own copy: it takes no step with it
                if self._scale == 0:
                    grad.zero_()
                else:
                    grad.mul_(self._scale)
        self.transport.post(self.record(info, self._iteration, self.rank, self.owner[info.name],
                                        "grad"), grad)

    def _deliver(self, rec: TransferRecord, payload: Any) -> None:
        if payload is not None:
            with self._stage_lock:
                later = rec.iteration > self._begun
                if later:  # this iteration's backward may still need the old values
                    self._staged.setdefault(rec.iteration, []).append((rec, payload))
            if not later:
                with torch.no_grad():
                    self.params[rec.tensor].copy_(payload)
        self.layers.arrive(rec.layer_index, rec.iteration)

    def _receive(self, iteration: int) -> None:
        """Post the receives of ``iteration``'s parameters (once)."""
        if iteration in self._receivers or iteration >= self.total:
            return
        t = self.transport
        receivers = Receivers(on_error=self.layers.fail)
        for s, shard in self._shards.items():
            receivers.start(t.receive, iteration, s,
                            {p.index: self.record(p, iteration, s, self.rank, "param")
                             for p in shard}, self._deliver)
        self._receivers[iteration] = receivers

    def begin(self, iteration: int) -> None:
        t = self.transport
        self._iteration, self._posted = iteration, set()
        self._receive(iteration)
        with self._stage_lock:
            self._begun = iteration
            staged = self._staged.pop(iteration, [])
        with torch.no_grad():
            for rec, payload in staged:
                self.params[rec.tensor].copy_(payload)
        self.layers.reset(iteration)
        # the next iteration's parameters may come while this one runs (early update)
        self._receive(iteration + 1)
        for s, shard in self._shards.items():
            t.plan(iteration, s, [self.record(p, iteration, self.rank, s, "grad") for p in shard])

    def gradients(self, iteration: int,
                  update: Callable[[Sequence[str]], None] | None = None) -> bool:
        """Hand over the last gradients and return: the next forward need not wait until
        they have left (its first layer waits for its parameters, which come only once the
        servers have this iteration's gradients of them), so the sends of iteration i are
        waited for at the end of i+1, or now at the job's last iteration."""
        for info in self.table:  # parameters the loss did not reach still owe their server
            if info.name not in self._posted:
                self._post_grad(info, None)
        self._receivers.pop(iteration).join()
        self._sending.append(iteration)
        last = iteration + 1 >= self.total
        while self._sending and (last or self._sending[0] < iteration):
            self.transport.complete(self._sending.pop(0))
        return False

    def close(self) -> None:
        # only a job stopped before its last iteration leaves sends unwaited for (it failed
        # or was stopped): nothing waits on them, and a dead peer must not hold the close
        self._sending.clear()
        super().close()

    def final_state(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self.index != 0:
            return {}, {}
        # the buffers: not a parameter under any of its names (a tied parameter's other
        # name is the servers' to report, see PsServer.final_state)
        names = set(self.params) | set(tied_aliases(model))
        return {}, {n: t.detach().cpu().clone() for n, t in model.state_dict().items()
                    if n not in names}
