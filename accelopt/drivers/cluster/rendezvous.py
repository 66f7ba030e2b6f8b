"""How the local ranks of a cluster run join their process group: rank 0's store listens
before any other rank tries to reach it.

Why: with ``init_method="tcp://..."`` every rank starts at once, rank 0 opens the
rendezvous store (a ``TCPStore``) and the others connect to it. A rank whose first connect
comes before rank 0 listens, which is the usual case when the ranks fork together, waits
out the store client's retry back-off (~0.55 s on this 2-core VM, measured on the default
run: every rank left ``init_process_group`` at the same instant, 0.55 s after entering
it). So rank 0 opens the store itself and says so through an event; the other ranks wait
for the event and connect once, at once.

Ranks under ``torchrun`` (``init_method="env://"``) meet in the store torch's ``env://``
rendezvous would use (torchrun's agent's, else one rank 0 opens), and first say there that
they have arrived, or why they will not join (:func:`refuse_at_rendezvous`: a rank whose
config was refused, e.g. a machine started without the ``hydra.run.dir`` the others were
given). Why: a rank that stopped before joining left the others waiting out the whole
``cluster.timeout_s``, and then their line blamed MASTER_ADDR, MASTER_PORT and WORLD_SIZE.
Now they stop at once with "rank N refused its config: <its line>", and where a rank never
arrives at all, their line names it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch.distributed as dist

from accelopt.errors import RankFailed, RankRefused

TORCHRUN = "env://"
"""The ``init_method`` of a torchrun rank."""


def join_group(backend: str, init_method: str, *, rank: int, world: int,
               timeout: timedelta, store_ready: Any | None = None) -> None:
    """``dist.init_process_group`` for this rank. ``store_ready``: an event shared by the
    run's local ranks (``multiprocessing``'s), set by rank 0 once its store listens; without
    it, ``init_method`` rendezvous as usual; under torchrun (``env://``) every rank first
    says it has arrived (:func:`arrive`)."""
    if store_ready is None and init_method == TORCHRUN:
        store = torchrun_store(rank, world, timeout)
        arrive(store, rank=rank, world=world, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world, timeout=timeout)
        return
    if store_ready is None:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world, timeout=timeout)
        return
    store = _store(init_method, rank=rank, world=world, timeout=timeout,
                   store_ready=store_ready)
    # The prefix torch gives the store of an init_method, so the keys are the same.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=timeout)


def _store(init_method: str, *, rank: int, world: int, timeout: timedelta,
           store_ready: Any) -> dist.TCPStore:
    address = urlsplit(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"a local rank joins through tcp://host:port, not {init_method!r}")
    if rank == 0:
        # wait_for_workers=False: listening is all the others need; the group's own set-up
        # waits for them.
        store = dist.TCPStore(address.hostname, address.port, world, is_master=True,
                              timeout=timeout, wait_for_workers=False)
        store_ready.set()
        return store
    if not store_ready.wait(timeout.total_seconds()):
        raise TimeoutError(f"rank 0 did not open the rendezvous store at {address.netloc} "
                           f"within {timeout.total_seconds():g} s")
    return dist.TCPStore(address.hostname, address.port, world, is_master=False,
                         timeout=timeout)


class NeverJoined(RankFailed):
    """Some ranks of a torchrun launch never arrived at the rendezvous within the timeout
    (not started, or stopped before joining without saying why)."""


def torchrun_store(rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The store torch's ``env://`` rendezvous would make for this rank: a client of
    torchrun's agent's store (``TORCHELASTIC_USE_AGENT_STORE``), else rank 0 opens it at
    MASTER_ADDR:MASTER_PORT; rank 0 does not wait for the others' connections here (they
    may never come: :func:`arrive` says which did not)."""
    host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    with _cpp_log_held():
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                             is_master=host, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True)


def _key(what: str, rank: int) -> str:
    """A key of the arrival, per torchrun attempt (a restarted launch meets afresh)."""
    return f"accelopt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{what}/{rank}"


def arrive(store: Any, *, rank: int, world: int, timeout: timedelta,
           refusal: str = "") -> None:
    """Say in ``store`` that this rank has arrived (``refusal``: the one line why it will not
    join), wait up to ``timeout`` for every rank to say the same, and raise where one will
    not join: :class:`~accelopt.errors.RankRefused` naming the rank that refused its config
    and why, else :class:`NeverJoined` naming the ranks that never arrived. Every rank that
    leaves here first waits until each rank that arrived has read the others' answers: the
    store may go with it (rank 0's, or the agent of a machine whose rank exits)."""
    store.set(_key("arrived", rank), refusal)
    keys = {r: _key("arrived", r) for r in range(world)}
    try:
        store.wait(list(keys.values()), timeout)
    except dist.DistStoreError:  # a timeout: who did not arrive is said below
        pass
    answers = {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}
    store.set(_key("read", rank), "")
    refused = {r: line for r, line in answers.items() if line and r != rank}
    missing = [r for r in range(world) if r not in answers]
    if not (refusal or refused or missing):
        return
    with contextlib.suppress(Exception):  # best effort: a peer's store may be gone already
        store.wait([_key("read", r) for r in answers], timeout)
    if refusal:
        return  # the caller raises this rank's own refusal
    if refused:
        first = min(refused)
        raise RankRefused(f"rank {first} refused its config: {refused[first]}", rank=first,
                          pid=None, iteration=None, cause=refused[first], exit_code=2)
    raise _never_joined(missing, rank, timeout)


def _never_joined(missing: list[int], rank: int, timeout: timedelta) -> NeverJoined:
    """The line of a rank that waited ``timeout`` in vain for the ranks ``missing``."""
    them = "it" if len(missing) == 1 else "them"
    return NeverJoined(
        f"{_ranks(missing)} never joined the rendezvous at MASTER_ADDR="
        f"{os.environ.get('MASTER_ADDR', '?')} MASTER_PORT={os.environ.get('MASTER_PORT', '?')} "
        f"within cluster.timeout_s={timeout.total_seconds():g} s (rank {rank} waited for "
        f"{them}): start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE; a "
        "rank that stopped before joining said why in its own output",
        rank=missing[0], pid=None, iteration=None, cause="never joined the rendezvous")


def refuse_at_rendezvous(line: str, *, rank: int, world: int, timeout: timedelta) -> None:
    """A torchrun rank whose config was refused before it joined: join the store anyway and
    leave ``line`` there, so the others stop at once with "rank N refused its config: <line>"
    instead of waiting out their timeout. Best effort (the caller raises its own error
    whatever happens): a store this rank cannot reach is no news to give."""
    with contextlib.suppress(Exception):
        store = torchrun_store(rank, world, timeout)
        arrive(store, rank=rank, world=world, timeout=timeout, refusal=line or "refused")


_CPP_LOG = re.compile(r"^(\[rank\d+\]:)?\[[IWEF]\d{4} |^Exception raised from |^frame #\d+"
                      r"|^<omitting python frames>|^\s*$")
"""A line of a record torch's C++ code logs (and the C++ stack frames it appends)."""


@contextlib.contextmanager
def _cpp_log_held() -> Iterator[None]:
    """Hold what is written to file descriptor 2 while this rank reaches the store, and
    pass it on after; on failure, without torch's C++ log records. Why: the store client
    logs each failed connect at ERROR with ~20 lines of C++ stack frames, and then raises
    the same in one line, which the rank's line quotes (``faults.rendezvous_failure``).
    The main thread's only (a rank's, under torchrun): the descriptor is the process's, and
    threads redirecting it at once would leave it pointing at one's temporary file."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    failed = True
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
            failed = False
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
            if failed:
                text = "".join(line for line in text.splitlines(keepends=True)
                               if not _CPP_LOG.match(line))
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


def _ranks(ranks: list[int]) -> str:
    """``rank 2`` or ``ranks 1, 2 and 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
