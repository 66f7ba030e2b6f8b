"""The transport: every parameter and gradient transfer of a cluster run goes through here,
and through the send/recv hook point, on top of torch.distributed (gloo / NCCL).

Point-to-point (parameter server). A transfer starts with a 20-int64 header (status, tensor
id, dtype, shape, payload bytes, sender's start time, sequence number, chunk index, chunk
count, chunk offset, total bytes); a payload of at most ``INLINE_BYTES`` travels in the
header's own message, right behind it, and a larger one as a second message on its own tag
(on NCCL, which needs both ends to name a message's size, every non-empty payload does).
The receiver posts every header's receive ``INLINE_BYTES`` larger than a header (gloo
fills a receive with a shorter message and the header says how much came), so a small
transfer is one message whose receive was posted before it left, where two messages, the
second posted only once the first is in, cost the receiver about twice the CPU
(``benchmarks/transport_cost.py``). The k-th message *started* from A to B in an
iteration uses sequence number k, so the
receiver reads them in exactly the order the sender started them, whatever tensors they
carry; a filtered transfer sends only its header (status "dropped"), and an encoded payload
may change dtype, shape or even become a pickled object (status "object").

Hook calls, per transfer: ``accelopt_transfer_filter`` and ``accelopt_transfer_encode``
(sender, when the transfer is posted), ``accelopt_transfer_decode`` and
``accelopt_transfer_done`` (receiver, when it has arrived); once per (iteration,
destination): ``accelopt_transfer_order``.

Ordered sends. When the order hook answers, the named tensors get priorities 0..n-1 and one
counter per (iteration, destination) enforces them: a posted transfer with priority p is
held until the counter reaches p, then started, and the counter advances. Tensors the order
does not name start as soon as they are posted (the default when nobody answers: the order
the sender happens to issue them). A held transfer whose predecessor never comes fails after
``order_timeout_s`` with an error naming the missing tensor and its priority.

Priority sends. When the answer is a :class:`~accelopt.types.TransferPriorities` (point to
point only), posted transfers wait in a priority queue per (iteration, destination) and the
highest-priority one starts whenever fewer than ``credit_bytes`` are in flight to that
destination; a watcher thread per destination returns a transfer's credit when its sends
have completed, i.e. been handed to the kernel: what the socket buffers and the shaped
queue hold beyond that is outside the window.

Partitioning (priority mode, ``partition_bytes > 0``). A payload larger than the partition
goes as several chunks, each a message of its own (header and payload slice, its own
sequence number) that competes for the window with its tensor's priority: a large
low-priority tensor in flight is preempted, between two of its chunks, by a higher-priority
transfer posted meanwhile. The receiver learns a tensor's chunk count from its first
chunk's header and posts that many more header receives (a later chunk's header always
follows its first, so every message the sender starts has its receive posted); it delivers
the tensor once its last chunk is in, assembled in place.

All-reduce. A gradient bucket is one transfer with destination -1 ("all ranks"), started as
an async ``all_reduce`` in the same enforced order; its bytes are what this rank sends on its
links for it (:func:`allreduce_wire_bytes`, :func:`allgather_wire_bytes`), not the buffer it
hands the collective, which 3 or more ranks send more than once; a completion thread timestamps each
bucket when its work finishes, so the timeline shows communication overlapping backward.
When nothing stands between a bucket and the wire (no filter, encode, decode or done hook,
and no order for the iteration), :meth:`Transport.allreduce_direct` starts it at once from
the caller's thread and times its end in the work's own future callback, the path of DDP's
built-in Python all-reduce hook: the same records and statistics, without a hand-off to the
completion thread.
"""

from __future__ import annotations

import dataclasses
import heapq
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from accelopt.drivers.cluster import threads
from accelopt.errors import AccelOptError, error_text
from accelopt.host import PluginHost
from accelopt.records import Span
from accelopt.types import TransferPriorities, TransferRecord

HEADER_LEN = 20
HEADER_BYTES = HEADER_LEN * 8
INLINE_BYTES = 64 * 1024
"""A payload of at most this many bytes goes in its header's message (module docstring):
every bias and norm, and most of a small model's weights; the receive buffers this adds
are allocated, not touched, beyond what arrives."""
MAX_DIMS = 8
DROPPED, TENSOR, OBJECT = 0, 1, 2
ALL_RANKS = -1
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class TransferOrderError(AccelOptError):
    """A transfer the order names was never posted: the held ones would wait forever."""


class CommunicationError(AccelOptError):
    """torch.distributed failed under a transfer (peer gone, timeout)."""


def allreduce_wire_bytes(nbytes: int, world: int) -> int:
    """What one rank sends on its links to all-reduce a buffer of ``nbytes`` over ``world``
    ranks: a ring all-reduce (gloo's algorithm on CPU, NCCL's ring) is a reduce-scatter and
    an all-gather of ``nbytes / world`` pieces, ``world - 1`` steps each, so
    ``2 (world - 1) / world`` of the buffer (1x with 2 ranks, 1.33x with 3, 0 alone). Why
    not the buffer itself: with 3 ranks that undercounted the kernel's byte counters by a
    quarter, and the bandwidth with it."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def allgather_wire_bytes(nbytes: int, world: int) -> int:
    """What one rank sends on its links to all-gather a buffer of ``nbytes`` (every rank's
    the same size) over ``world`` ranks: a ring all-gather forwards each of the other ranks'
    buffers and its own once, ``world - 1`` buffers."""
    return (world - 1) * nbytes if world > 1 else 0


def tag_for(iteration: int, seq: int, part: int) -> int:
    """Tags are unique per direction of a pair within 1024 consecutive iterations."""
    return ((iteration % 1024) << 21) | ((seq & 0xFFFFF) << 1) | part


@dataclass
class _Item:
    record: TransferRecord
    payload: Any
    keep: bool
    posted_s: float
    future: Any = None
    """All-reduce only: a ``torch.futures.Future`` given the decoded sum when it is done (a
    DDP communication hook returns it), instead of keeping it for ``finish_allreduce``."""
    wire: tuple[int, torch.Tensor | None, list[int]] | None = None
    """(status, flat payload bytes, meta), made when the first message starts."""
    chunk: int = 0
    """The next chunk to start (point to point)."""
    chunks: int = 1
    """How many messages the payload goes as (more than one: partitioned)."""


@dataclass
class _OutStream:
    iteration: int
    destination: int
    order: list[str] | None
    priority: dict[str, int]
    planned: int
    credit: int | None = None
    """Priority mode's window in bytes (``None``: a strict order or none)."""
    partition: int = 0
    """Priority mode: the largest payload one message carries (0: whole tensors)."""
    pace: float = 0.0
    """Priority mode: the link's bytes/s; a transfer's credit returns no sooner than its
    bytes take at that rate after the previous one's (0: when its sends complete)."""
    queue: list[tuple[int, int, _Item]] = field(default_factory=list)
    """Priority mode: (priority, posting number, item) waiting for credit (a heap)."""
    inflight: int = 0
    overtaken: int = 0
    """Priority mode: transfers started ahead of one posted before them."""
    counter: int = 0
    started: int = 0
    """Messages started (the next sequence number)."""
    begun: int = 0
    """Transfers whose first message has started."""
    posted: int = 0
    held: int = 0
    inversions: int = 0
    max_started_priority: int = -1
    pending: dict[int, _Item] = field(default_factory=dict)
    works: list[Any] = field(default_factory=list)
    buffers: list[Any] = field(default_factory=list)


@dataclass
class TransportStats:
    """What this rank's transport did (returned to the launcher with the rank's result)."""

    transfers: int = 0
    dropped: int = 0
    payload_bytes: int = 0
    header_bytes: int = 0
    logical_bytes: int = 0
    ordered: int = 0
    held: int = 0
    inversions: int = 0
    overtaken: int = 0
    """Priority mode: transfers started ahead of one that was posted before them."""
    partitioned: int = 0
    """Priority mode: transfers sent as more than one chunk."""
    chunks: int = 0
    """Priority mode: messages of partitioned transfers."""
    updated_early: int = 0
    """PS server, early update: tensors updated as their gradients completed."""
    bytes_by_iteration: dict[int, int] = field(default_factory=dict)
    """What this rank sent on its links, by iteration (``bytes_per_iteration``)."""
    collective_bytes_by_iteration: dict[int, int] = field(default_factory=dict)
    """All-reduce: the buffers this rank handed the collectives, by iteration (with 2 ranks
    what it sends; with more, less: :func:`allreduce_wire_bytes`)."""
    started_log: list[tuple[int, int, int, str]] = field(default_factory=list)
    """(iteration, destination, sequence, tensor) in the order transfers started."""
    arrival_log: list[tuple[int, int, int, str]] = field(default_factory=list)
    """(iteration, source, sequence, tensor) in the order transfers arrived here."""


Clock = Callable[[], float]


class Transport:
    """One per rank. ``process`` names the rank's timeline process, ``clock`` gives seconds
    since the run started (wall clock, shared by the processes of one machine)."""

    def __init__(
        self,
        *,
        rank: int,
        host: PluginHost,
        t0_epoch: float,
        process: str,
        timeout_s: float,
        device: torch.device,
        tensor_ids: dict[str, int] | None = None,
        group: Any = None,
    ) -> None:
        self.rank = rank
        self.group = group
        """Process group of the point-to-point transfers (``None``: the default group). A
        multi-job cluster run gives each job its own group, so the transfers of different
        jobs can never match each other's tags."""
        self.tensor_ids = dict(tensor_ids or {})
        self.host = host
        self.t0_epoch = t0_epoch
        self.process = process
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.order_timeout_s = max(0.5, timeout_s / 2)
        self.device = device
        self.stats = TransportStats()
        self.spans: list[Span] = []
        self._lock = threading.Condition()
        self._out: dict[tuple[int, int], _OutStream] = {}
        self._completer: _Completer | None = None
        self._watchers: dict[int, _SendWatcher] = {}
        self._inline = INLINE_BYTES if device.type == "cpu" else 0
        """Payload bytes that go in the header's message: gloo (CPU) fills a receive with a
        shorter message; NCCL (CUDA) needs both ends to name the same size, so there every
        payload but an empty one goes as a message of its own."""
        self._world_size: int | None = None
        self._peers: dict[int, tuple[Any, int]] = {}
        """Per peer rank: the group and its rank there (``_peer``)."""
        self._link_free: dict[int, float] = {}
        """Pacing: per destination, when the link is free of what was started to it
        (``time.monotonic()``)."""
        self.failure: BaseException | None = None
        """The first error of a collective (timed out, a peer died) or of the order: a DDP
        hook hands it to backward, which raises it wrapped; the rank raises this one."""
        self._filter = host.implements("accelopt_transfer_filter")
        self._encode = host.implements("accelopt_transfer_encode")
        self._decode = host.implements("accelopt_transfer_decode")
        self._done = host.implements("accelopt_transfer_done")
        self._hooked = bool(self._filter or self._encode or self._decode or self._done)
        """A transfer hook sees every all-reduce: :meth:`allreduce_direct` never applies."""

    def now(self) -> float:
        return time.time() - self.t0_epoch

    def _peer(self, rank: int) -> tuple[Any, int]:
        """(the process group, ``rank``'s rank in it) for a point-to-point message, found
        once per peer. Why not ``dist.isend``/``dist.irecv``: their argument checks and group
        lookups run twice per transfer (header and payload) on a worker's core, and every
        tensor here is a plain uint8 or int64 buffer, which is all those checks would let
        through. With the header built as one list, a transfer costs the receiver 166
        instead of 200 us of CPU and the sender 132 instead of 176 us
        (``benchmarks/transport_cost.py``, 5 paired invocations)."""
        found = self._peers.get(rank)
        if found is None:
            group = self.group if self.group is not None else dist.group.WORLD
            found = self._peers[rank] = (group, dist.get_group_rank(group, rank))
        return found

    def _send(self, tensor: torch.Tensor, destination: int, tag: int) -> Any:
        group, rank = self._peer(destination)
        return group.send([tensor], rank, tag)

    def _recv(self, tensor: torch.Tensor, source: int, tag: int) -> Any:
        group, rank = self._peer(source)
        return group.recv([tensor], rank, tag)

    # -- sending ---------------------------------------------------------------------------

    def plan(self, iteration: int, destination: int,
             records: Sequence[TransferRecord]) -> TransferPriorities | None:
        """Declare the transfers of one iteration to ``destination`` and ask for an order;
        returns the answer when it asked for priority scheduling (else ``None``)."""
        order, schedule = None, None
        if self.host.implements("accelopt_transfer_order"):
            answer = self.host.call(
                "accelopt_transfer_order", transfers=list(records), destination=destination
            )
            if isinstance(answer, TransferPriorities):
                schedule = answer if destination != ALL_RANKS else None
                answer = answer.order
            order = None if answer is None else [str(n) for n in answer]
        priority = {name: p for p, name in enumerate(order)} if order else {}
        credit = None if schedule is None else max(0, int(schedule.credit_bytes))
        partition = 0 if schedule is None else max(0, int(schedule.partition_bytes))
        pace = 0.0 if schedule is None else max(0.0, float(schedule.pace_bytes_per_s))
        with self._lock:
            self._out[(iteration, destination)] = _OutStream(
                iteration, destination, None if schedule else order, priority,
                planned=len(records), credit=credit, partition=partition, pace=pace,
            )
            if order:
                self.stats.ordered += len(order)
        return schedule

    def post(self, record: TransferRecord, payload: Any, future: Any = None) -> None:
        """Hand over one transfer (any thread: autograd hooks post gradients). It starts now,
        or when its predecessors in the enforced order have started. ``future`` (all-reduce
        only) receives the decoded sum, or the error, when the collective is done."""
        keep = payload is not None  # no gradient: a header says so, and nothing else goes
        if keep and self._filter:
            answers = self.host.call("accelopt_transfer_filter", record=record)
            keep = all(a is not False for a in answers)
        if keep and self._encode:
            payload = self.host.chain(
                "accelopt_transfer_encode", payload, lambda p: {"record": record, "payload": p}
            )
        item = _Item(record, payload, keep, self.now(), future)
        with self._lock:
            stream = self._out[(record.iteration, record.destination)]
            stream.posted += 1
            prio = stream.priority.get(record.tensor)
            if stream.credit is not None:
                rank = len(stream.priority) if prio is None else prio
                heapq.heappush(stream.queue, (rank, stream.posted, item))
                self._pump(stream)
            elif prio is None:
                self._start(stream, item, None)
            else:
                if prio != stream.counter:
                    stream.held += 1
                stream.pending[prio] = item
                while stream.counter in stream.pending:
                    p = stream.counter
                    stream.counter += 1
                    self._start(stream, stream.pending.pop(p), p)
            self._lock.notify_all()

    def _pump(self, stream: _OutStream) -> None:
        """Priority mode (lock held): start the best waiting transfers while credit lasts; a
        partitioned one starts one chunk at a time and goes back into the queue with its
        priority, so a better transfer posted meanwhile goes before its next chunk."""
        while stream.queue and (stream.credit == 0 or stream.inflight < stream.credit):
            priority, posted, item = heapq.heappop(stream.queue)
            if item.chunk == 0 and any(other[1] < posted for other in stream.queue):
                stream.overtaken += 1
            before = len(stream.works)
            nbytes = self._start(stream, item, None)
            if item.chunk < item.chunks:
                heapq.heappush(stream.queue, (priority, posted, item))
            if stream.credit:
                # the watcher owns these works: a gloo send must be waited on exactly once
                works = stream.works[before:]
                del stream.works[before:]
                stream.inflight += nbytes
                self._watcher(stream.destination).put(stream, works, nbytes,
                                                      self._paced(stream, nbytes))

    def _paced(self, stream: _OutStream, nbytes: int) -> float:
        """Pacing (lock held): when this transfer's bytes have left a link of ``stream.pace``
        bytes/s, sent back to back after the previous ones to that destination (0.0: no
        pacing). A send completes when the kernel has its bytes, and the socket buffers and
        the shaped queue hold far more than a window: without pacing the transfers a window
        holds back wait there instead, first posted first, where priorities cannot reach."""
        if not stream.pace:
            return 0.0
        start = max(time.monotonic(), self._link_free.get(stream.destination, 0.0))
        done = self._link_free[stream.destination] = start + nbytes / stream.pace
        return done

    def _returned(self, stream: _OutStream, nbytes: int) -> None:
        """A priority transfer's sends completed: its credit is free again."""
        with self._lock:
            stream.inflight -= nbytes
            self._pump(stream)
            self._lock.notify_all()

    def _watcher(self, destination: int) -> _SendWatcher:
        watcher = self._watchers.get(destination)
        if watcher is None:
            watcher = self._watchers[destination] = _SendWatcher(self, destination)
        return watcher

    def _start(self, stream: _OutStream, item: _Item, prio: int | None) -> int:
        """Start one transfer, or the next chunk of a partitioned one (lock held); returns
        the bytes it puts on the link."""
        rec = item.record
        seq = self._numbered(stream, rec, first=item.chunk == 0)
        if item.chunk == 0 and prio is not None:
            if prio < stream.max_started_priority:
                stream.inversions += 1
            stream.max_started_priority = max(stream.max_started_priority, prio)
        if rec.destination == ALL_RANKS:
            item.chunk = 1
            self._start_allreduce(stream, item, seq)
            return 0
        if item.wire is None:
            item.wire = self._wire(stream, item)
        status, data, meta = item.wire
        fields = [0] * HEADER_LEN  # built as a list: one tensor made, not 14 stores into one
        chunk = item.chunk
        item.chunk += 1
        if data is not None:
            size = -(-data.numel() // item.chunks)  # every chunk but the last: this many
            lo, hi = chunk * size, min(data.numel(), (chunk + 1) * size)
            fields[2:4 + MAX_DIMS] = meta
            fields[12], fields[18], fields[19] = hi - lo, lo, data.numel()
            data = data[lo:hi]
        fields[0], fields[1] = status, self.tensor_ids.get(rec.tensor, -1)
        fields[13], fields[14], fields[15] = time.time_ns(), rec.iteration, seq
        fields[16], fields[17] = chunk, item.chunks
        header = torch.tensor(fields, dtype=torch.int64, device=self.device).view(torch.uint8)
        nbytes = HEADER_BYTES
        self.stats.header_bytes += HEADER_BYTES
        if data is not None and data.numel() <= self._inline:  # one message: header + payload
            header = torch.cat((header, data.to(self.device)))
        stream.buffers.append(header)
        stream.works.append(self._send(header, rec.destination, tag_for(rec.iteration, seq, 0)))
        if data is not None:
            if data.numel() > self._inline:
                data = data.to(self.device)
                stream.buffers.append(data)
                stream.works.append(self._send(data, rec.destination,
                                               tag_for(rec.iteration, seq, 1)))
            nbytes += data.numel()
            self.stats.payload_bytes += data.numel()
        by_it = self.stats.bytes_by_iteration
        by_it[rec.iteration] = by_it.get(rec.iteration, 0) + nbytes
        return nbytes

    def _numbered(self, stream: _OutStream, rec: TransferRecord, *, first: bool) -> int:
        """The sequence number of the next message started on ``stream`` (lock held), logged;
        ``first``: the transfer's first message, which counts the transfer as begun."""
        seq = stream.started
        stream.started += 1
        self.stats.started_log.append((rec.iteration, rec.destination, seq, rec.tensor))
        if first:
            stream.begun += 1
            self.stats.transfers += 1
            self.stats.logical_bytes += rec.nbytes
        return seq

    def _wire(self, stream: _OutStream, item: _Item) -> tuple[int, torch.Tensor | None, list[int]]:
        """Serialise a transfer's payload once, and decide how many chunks it goes as."""
        if not item.keep:
            self.stats.dropped += 1
            return DROPPED, None, []
        status, data, meta = _serialise(item.payload)
        if stream.partition and data.numel() > stream.partition:
            item.chunks = -(-data.numel() // stream.partition)
            self.stats.partitioned += 1
            self.stats.chunks += item.chunks
        return status, data, meta

    def wait_started(self, iteration: int) -> None:
        """Block until every planned transfer of ``iteration`` has started; a transfer held
        behind one that never comes turns into :class:`TransferOrderError`."""
        deadline = time.monotonic() + self.order_timeout_s
        with self._lock:
            for (it, _dest), stream in sorted(self._out.items()):
                if it != iteration:
                    continue
                while stream.begun < stream.planned:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.failure = self.failure or self._order_error(stream)
                        raise self.failure
                    self._lock.wait(min(left, 0.5))

    def _order_error(self, stream: _OutStream) -> TransferOrderError:
        assert stream.order is not None or stream.posted < stream.planned
        if stream.order and stream.counter < len(stream.order):
            name = stream.order[stream.counter]
            waiting = len(stream.pending)
            return TransferOrderError(
                f"rank {self.rank}, iteration {stream.iteration}: transfer '{name}' (priority "
                f"{stream.counter}) to rank {stream.destination} was not issued within "
                f"{self.order_timeout_s:g} s and {waiting} later transfer(s) wait behind it; "
                "the order from accelopt_transfer_order must name only tensors the sender sends"
            )
        return TransferOrderError(
            f"rank {self.rank}, iteration {stream.iteration}: only {stream.posted} of "
            f"{stream.planned} planned transfers to rank {stream.destination} were issued "
            f"within {self.order_timeout_s:g} s"
        )

    def complete(self, iteration: int) -> None:
        """Wait until every send of ``iteration`` has left (buffers may be reused after)."""
        self.wait_started(iteration)
        with self._lock:
            streams = [s for (it, _), s in self._out.items() if it == iteration]
            for s in streams:
                del self._out[(s.iteration, s.destination)]
                self.stats.held += s.held
                self.stats.inversions += s.inversions
                self.stats.overtaken += s.overtaken
        for stream in streams:
            for work in stream.works:
                _wait(work, self.timeout, f"rank {self.rank}: sending to rank "
                      f"{stream.destination} at iteration {iteration}")
            if stream.credit:
                self._drained(stream)

    def _drained(self, stream: _OutStream) -> None:
        """Priority mode: wait until the watcher has seen every send of ``stream`` complete."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while (stream.inflight or stream.queue) and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommunicationError(
                        f"rank {self.rank}: sending to rank {stream.destination} at iteration "
                        f"{stream.iteration} did not finish within {self.timeout_s:g} s")
                self._lock.wait(min(left, 0.5))
            if self.failure is not None:
                raise self.failure

    # -- receiving -------------------------------------------------------------------------

    def _post_receives(self, iteration: int, source: int, n: int,
                       where: str) -> queue.SimpleQueue[Any]:
        """Post every header receive at once and, from a poster thread, each payload's
        receive the moment its header is in, in sequence order (a payload that came in its
        header's message needs none); queue ``(header, work or None, buffer)`` per message
        (or the exception that stopped the poster). A partitioned
        transfer's first header posts the receives of its other chunks' headers, and its
        chunks' payloads land in one buffer (the queued ``buffer`` is that whole buffer).

        Why a thread: gloo's TCP transport moves a payload only once its receive is posted.
        Posting it from the thread that then blocks on the payload put one wake-up of that
        Python thread on the link's critical path per transfer; while forward ran at the same
        time (what a good transfer order achieves) it competed for the GIL and the cores and
        the link idled between transfers (0.21 vs 0.03 ms per transfer measured by the tictac
        benchmark). The order on the link is unchanged: receives are posted in sequence."""
        headers: list[torch.Tensor] = []
        hworks: list[Any] = []

        def post_headers(count: int) -> None:
            for _ in range(count):
                k = len(headers)
                headers.append(torch.empty(HEADER_BYTES + self._inline, dtype=torch.uint8,
                                           device=self.device))
                hworks.append(self._recv(headers[k], source, tag_for(iteration, k, 0)))

        post_headers(n)
        ready: queue.SimpleQueue[Any] = queue.SimpleQueue()  # C: no lock and condition in Python

        def poster() -> None:
            assembling: dict[int, torch.Tensor] = {}
            try:
                k = 0
                while k < len(headers):
                    _wait(hworks[k], self.timeout, where)
                    message = headers[k]
                    h = message[:HEADER_BYTES].view(torch.int64).cpu().tolist()
                    k += 1
                    pwork, data = None, None
                    chunk, chunks, size = int(h[16]), int(h[17]), int(h[12])
                    if chunk == 0 and chunks > 1:
                        post_headers(chunks - 1)
                    if int(h[0]) != DROPPED:
                        inline = (message[HEADER_BYTES:HEADER_BYTES + size]
                                  if size <= self._inline else None)
                        into, data = self._payload_buffer(h, assembling, inline)
                        if inline is None:
                            pwork = self._recv(into, source, tag_for(iteration, int(h[15]), 1))
                    ready.put((h, pwork, data))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the receiving thread
                ready.put(exc)

        threads.start(poster, name=f"recv-post {source}")
        return ready

    def _payload_buffer(self, h: list[int], assembling: dict[int, torch.Tensor],
                        inline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(where this message's payload lands, the buffer the tensor is read from): its own
        buffer, or its slice of the partitioned tensor's one (made at its first chunk). A
        payload that came ``inline`` in its header's message is read where it is, or copied
        into its slice of the partitioned tensor."""
        chunk, chunks, tensor_id = int(h[16]), int(h[17]), int(h[1])
        if chunks == 1:
            data = torch.empty(int(h[12]), dtype=torch.uint8,
                               device=self.device) if inline is None else inline
            return data, data
        whole = assembling.get(tensor_id)
        if whole is None:
            whole = assembling[tensor_id] = torch.empty(int(h[19]), dtype=torch.uint8,
                                                        device=self.device)
        if chunk == chunks - 1:
            del assembling[tensor_id]
        into = whole[int(h[18]):int(h[18]) + int(h[12])]
        if inline is not None:
            into.copy_(inline)
        return into, whole

    def receive(
        self,
        iteration: int,
        source: int,
        expected: dict[int, TransferRecord],
        deliver: Callable[[TransferRecord, Any], None],
    ) -> None:
        """Receive the ``len(expected)`` transfers ``source`` sends this rank in
        ``iteration``, in the order it started them (a partitioned one when its last chunk
        is in); ``deliver(record, payload)`` each (``payload`` is ``None`` for a filtered
        transfer). Blocking: run it in a thread."""
        n = len(expected)
        if n == 0:
            return
        where = f"rank {self.rank}: receiving from rank {source} at iteration {iteration}"
        ready = self._post_receives(iteration, source, n, where)
        first_s: dict[int, float] = {}
        delivered = 0
        while delivered < n:
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            h, pwork, data = item
            status, tensor_id, seq = int(h[0]), int(h[1]), int(h[15])
            chunk, chunks = int(h[16]), int(h[17])
            if pwork is not None:
                _wait(pwork, self.timeout, where)
            sent_s = int(h[13]) / 1e9 - self.t0_epoch
            if chunk < chunks - 1:  # more of this tensor to come
                first_s.setdefault(tensor_id, sent_s)
                continue
            delivered += 1
            end_s = self.now()
            start_s = first_s.pop(tensor_id, sent_s)
            record = expected.get(tensor_id)
            if record is None:
                raise CommunicationError(f"{where}: unexpected tensor id {tensor_id}")
            wire = HEADER_BYTES * chunks + (0 if data is None else data.numel())
            record = dataclasses.replace(record, wire_bytes=wire)
            payload = None if data is None else _deserialise(status, data, h)
            if payload is not None and self._decode:
                payload = self.host.chain(
                    "accelopt_transfer_decode", payload,
                    lambda p, r=record: {"record": r, "payload": p}, reverse=True,
                )
            self._record(record, start_s, end_s, seq, dropped=payload is None)
            self.stats.arrival_log.append((iteration, source, seq, record.tensor))
            deliver(record, payload)

    def _record(self, rec: TransferRecord, start_s: float, end_s: float, seq: int,
                dropped: bool = False) -> None:
        dest = "all" if rec.destination == ALL_RANKS else str(rec.destination)
        self.spans.append(
            Span(
                name=rec.tensor,
                track=f"link {rec.source}->{dest}",
                start_s=start_s,
                end_s=end_s,
                category="comm",
                process=self.process,
                args={
                    "iteration": rec.iteration, "source": rec.source,
                    "destination": rec.destination, "tensor": rec.tensor,
                    # what crossed the link (headers, a codec's compressed payload): the
                    # bandwidth and per-iteration bytes count these; the tensor's own size
                    # is beside them
                    "bytes": rec.wire_bytes or (0 if dropped else rec.nbytes),
                    "tensor_bytes": rec.nbytes, "layer_index": rec.layer_index,
                    "kind": rec.kind, "sequence": seq,
                },
            )
        )
        if self._done:
            self.host.call("accelopt_transfer_done", record=rec, start_s=start_s, end_s=end_s)

    # -- all-reduce ------------------------------------------------------------------------

    def _start_allreduce(self, stream: _OutStream, item: _Item, seq: int) -> None:
        payload = item.payload
        if isinstance(payload, tuple) and all(isinstance(p, torch.Tensor) for p in payload):
            self._start_allgather(item, seq)
            return
        if not isinstance(payload, torch.Tensor):
            raise CommunicationError(
                f"rank {self.rank}: an all-reduce payload must stay a tensor (summed) or "
                f"become a tuple of tensors (gathered) after accelopt_transfer_encode, got "
                f"{type(payload).__name__}"
            )
        if not item.keep:  # a collective cannot be skipped by one rank: contribute zeros
            payload = torch.zeros_like(payload)
            self.stats.dropped += 1
        start_s = self.now()
        work = dist.all_reduce(payload, async_op=True, group=self.group)
        nbytes = payload.numel() * payload.element_size()
        record = self._count_allreduce(item.record, nbytes,
                                       allreduce_wire_bytes(nbytes, self._world()))
        if self._completer is None:
            self._completer = _Completer(self)
        self._completer.put((record, payload, work, start_s, seq, item.future))

    def allreduce_direct(self, record: TransferRecord,
                         tensor: torch.Tensor) -> torch.futures.Future | None:
        """Start the sum of ``tensor`` over the group now, when no transfer hook is
        implemented and the iteration's transfers have no order; ``None`` otherwise (then
        :meth:`post` it). The returned future yields ``tensor`` summed in place once the
        work is done, its span timed in the work's completion callback (gloo's or NCCL's
        thread); a failed work fails it and becomes the rank's error."""
        if self._hooked:
            return None
        with self._lock:
            stream = self._out[(record.iteration, ALL_RANKS)]
            if stream.priority:
                return None
            stream.posted += 1
            seq = self._numbered(stream, record, first=True)
            nbytes = tensor.numel() * tensor.element_size()
            record = self._count_allreduce(record, nbytes,
                                           allreduce_wire_bytes(nbytes, self._world()))
            self._lock.notify_all()
        start_s = self.now()
        work = dist.all_reduce(tensor, async_op=True, group=self.group)

        def finished(done: torch.futures.Future) -> torch.Tensor:
            try:
                done.wait()
            except Exception as exc:
                error = _communication_error(
                    exc, f"rank {self.rank}: all-reduce of {record.tensor} at iteration "
                    f"{record.iteration}")
                self.failure = self.failure or error
                raise error from exc
            self._record(record, start_s, self.now(), seq)
            return tensor

        return work.get_future().then(finished)

    def _world(self) -> int:
        """The ranks of this transport's collectives, found once (1 outside a process
        group: a transport driven by hand)."""
        if self._world_size is None:
            self._world_size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        return self._world_size

    def _count_allreduce(self, record: TransferRecord, handed: int, wire: int) -> TransferRecord:
        """The statistics of one started collective: this rank ``handed`` it that many bytes
        and sends ``wire`` on its links for it; the record with its wire bytes."""
        self.stats.payload_bytes += wire
        for by_it, n in ((self.stats.bytes_by_iteration, wire),
                         (self.stats.collective_bytes_by_iteration, handed)):
            by_it[record.iteration] = by_it.get(record.iteration, 0) + n
        return dataclasses.replace(record, wire_bytes=wire)

    def _start_allgather(self, item: _Item, seq: int) -> None:
        """A bucket an encoder turned into a tuple of tensors (e.g. sparse indices and
        values, which cannot be summed) is all-gathered instead of all-reduced: the decoder
        then receives a list with every rank's tuple, in rank order (1-D parts; sizes may
        differ between ranks, dtypes may not). A filtered bucket contributes empty parts."""
        parts = [p.detach().reshape(-1) for p in item.payload]
        if not item.keep:
            parts = [p[:0] for p in parts]
            self.stats.dropped += 1
        start_s = self.now()
        world = self._world()
        sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=self.device)
        all_sizes = [torch.empty_like(sizes) for _ in range(world)]
        dist.all_gather(all_sizes, sizes, group=self.group)  # tiny, synchronous: the length
        widths = [p.element_size() for p in parts]
        lengths = [sum(int(n) * w for n, w in zip(s.tolist(), widths, strict=True))
                   for s in all_sizes]
        longest = max(lengths + [1])
        flat = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        if parts and lengths[self.rank]:
            flat[:lengths[self.rank]] = torch.cat([p.contiguous().view(torch.uint8)
                                                   for p in parts])
        outs = [torch.empty_like(flat) for _ in range(world)]
        work = dist.all_gather(outs, flat, async_op=True, group=self.group)
        gathered = _Gathered(outs, [s.tolist() for s in all_sizes],
                             [p.dtype for p in parts], widths)
        # what this rank hands the collectives: its buffer padded to the longest rank's,
        # and its message of part lengths (the encoded length alone understated it); a
        # ring all-gather sends each of them on to world - 1 ranks
        handed = longest + sizes.numel() * sizes.element_size()
        record = self._count_allreduce(item.record, handed, allgather_wire_bytes(handed, world))
        if self._completer is None:
            self._completer = _Completer(self)
        self._completer.put((record, gathered, work, start_s, seq, item.future))

    def finish_allreduce(self, iteration: int) -> dict[str, torch.Tensor]:
        """Wait for every bucket of ``iteration``; return decoded, summed payloads by name."""
        self.wait_started(iteration)
        with self._lock:
            stream = self._out.pop((iteration, ALL_RANKS), None)
            if stream is not None:
                self.stats.held += stream.held
                self.stats.inversions += stream.inversions
        if self._completer is None:
            return {}
        return self._completer.drain(iteration)

    def close(self) -> None:
        if self._completer is not None:
            self._completer.stop()
        for watcher in self._watchers.values():
            watcher.stop()


class _WorkWaiter:
    """A thread that takes entries off a queue, in order, until ``stop``: waiting for works
    must not block the thread that starts them."""

    def __init__(self, transport: Transport, name: str) -> None:
        self.transport = transport
        self.queue: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            entry = self.queue.get()
            if entry is None:
                return
            self.handle(entry)
            del entry  # hold no finished work while waiting for the next entry

    def handle(self, entry: Any) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=self.transport.timeout_s)


class _SendWatcher(_WorkWaiter):
    """Priority mode: waits, in start order, for the sends to one destination and returns
    each transfer's credit to its stream (so the next transfer by priority can start)."""

    def __init__(self, transport: Transport, destination: int) -> None:
        super().__init__(transport, f"credit {destination}")

    def put(self, stream: _OutStream, works: list[Any], nbytes: int,
            paced_until: float = 0.0) -> None:
        self.queue.put((stream, works, nbytes, paced_until))

    def handle(self, entry: Any) -> None:
        t = self.transport
        stream, works, nbytes, paced_until = entry
        try:
            for work in works:
                _wait(work, t.timeout, f"rank {t.rank}: sending to rank "
                      f"{stream.destination} at iteration {stream.iteration}")
        except BaseException as exc:  # noqa: BLE001 - the rank raises it
            t.failure = t.failure or exc
        left = paced_until - time.monotonic()
        if left > 0 and t.failure is None:
            time.sleep(left)  # pacing: the link is still busy with these bytes
        t._returned(stream, nbytes)


class _Completer(_WorkWaiter):
    """Waits for all-reduce works in start order and timestamps each one's end."""

    def __init__(self, transport: Transport) -> None:
        self.done: dict[int, dict[str, torch.Tensor]] = {}
        self.error: BaseException | None = None
        self.pending = 0
        self.cv = threading.Condition()
        super().__init__(transport, "allreduce-completer")

    def put(self, entry: Any) -> None:
        with self.cv:
            self.pending += 1
        self.queue.put(entry)

    def handle(self, entry: Any) -> None:
        t = self.transport
        rec, payload, work, start_s, seq, future = entry
        try:
            _wait(work, t.timeout, f"rank {t.rank}: all-reduce of {rec.tensor} at "
                  f"iteration {rec.iteration}")
            end_s = t.now()
            if isinstance(payload, _Gathered):
                payload = payload.per_rank()
            if t._decode:
                payload = t.host.chain(
                    "accelopt_transfer_decode", payload,
                    lambda p, r=rec: {"record": r, "payload": p}, reverse=True,
                )
            t._record(rec, start_s, end_s, seq)
        except BaseException as exc:  # handed to the main thread in drain()
            with self.cv:
                self.error = self.error or exc
                t.failure = t.failure or exc
                self.pending -= 1
                self.cv.notify_all()
            if future is not None:
                future.set_exception(exc)
            return
        if future is not None:  # whoever waits on it (DDP) takes the result
            future.set_result(payload)
            # hold no collective's work between buckets: a process that ends while this
            # thread still owns one may abort when its process group is destroyed
            del entry, payload, work, future
            with self.cv:
                self.pending -= 1
                self.cv.notify_all()
            return
        with self.cv:
            self.done.setdefault(rec.iteration, {})[rec.tensor] = payload
            self.pending -= 1
            self.cv.notify_all()

    def drain(self, iteration: int) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + self.transport.timeout_s
        with self.cv:
            while self.pending > 0 and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommunicationError(
                        f"rank {self.transport.rank}: all-reduce did not finish within "
                        f"{self.transport.timeout_s:g} s at iteration {iteration}"
                    )
                self.cv.wait(min(left, 0.5))
            if self.error is not None:
                raise self.error
            return self.done.pop(iteration, {})


@dataclass
class _Gathered:
    """The buffers of one all-gathered bucket; ``per_rank()`` cuts them back into every
    rank's tuple of tensors once the gather has finished."""

    outs: list[torch.Tensor]
    sizes: list[list[int]]
    dtypes: list[torch.dtype]
    widths: list[int]

    def per_rank(self) -> list[tuple[torch.Tensor, ...]]:
        result = []
        for buf, counts in zip(self.outs, self.sizes, strict=True):
            parts, offset = [], 0
            for n, dtype, width in zip(counts, self.dtypes, self.widths, strict=True):
                parts.append(buf[offset:offset + n * width].clone().view(dtype))
                offset += n * width
            result.append(tuple(parts))
        return result


# -- helpers -----------------------------------------------------------------------------


def _serialise(payload: Any) -> tuple[int, torch.Tensor, list[int]]:
    """Payload -> (status, flat uint8 tensor, [dtype, ndim, *shape padded to MAX_DIMS])."""
    if isinstance(payload, torch.Tensor) and payload.dim() <= MAX_DIMS and payload.dtype in _DTYPE_CODE:
        t = payload.detach().cpu().contiguous()
        shape = list(t.shape) + [0] * (MAX_DIMS - t.dim())
        return TENSOR, t.reshape(-1).view(torch.uint8), [_DTYPE_CODE[t.dtype], t.dim(), *shape]
    raw = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return OBJECT, data, [0, 0, *([0] * MAX_DIMS)]


def _deserialise(status: int, data: torch.Tensor, header: list[int]) -> Any:
    data = data.cpu()
    if status == OBJECT:
        return pickle.loads(data.numpy().tobytes())
    dtype, ndim = _DTYPES[int(header[2])], int(header[3])
    shape = [int(s) for s in header[4:4 + ndim]]
    return data.view(dtype).reshape(shape)


def _wait(work: Any, timeout: timedelta, where: str) -> None:
    try:
        work.wait(timeout)
    except Exception as exc:
        raise _communication_error(exc, where) from exc


def _communication_error(exc: BaseException, where: str) -> CommunicationError:
    """One line: where, and the first line of torch's (often multi-line) error."""
    return CommunicationError(f"{where}: {error_text(exc)}")
