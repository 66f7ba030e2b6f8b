"""Where a hook call's cost goes: instructions per call of each piece of the hook-call path,
counted by valgrind's callgrind (a count, not a time: another process on the machine cannot
change it), without torch (the path imports none).

Each piece runs in its own process for a short and a long loop; the difference of the two
totals over the difference of the loop lengths is its per-call count (imports and set-up
cancel out), less the empty loop's own count. The pieces, from the floor up:

  function call    a Python call of a function that does nothing (the interpreter's floor)
  lock pair        acquire + release of the process's hook lock (an RLock)
  clock read       time.perf_counter(), twice per traced call
  noop body        the noop plugin's implementation called directly (counts the call)
  hook call        the same implementation through PluginHost's one path (lock, dispatch,
                   error naming), trace off
  hook call, trace the same with the hook timeline on (accelopt run's default)
  serial call      the same without the hook lock and without a list of answers: the step's
                   events in a one-job run, whose one thread makes every hook call
  keyword call     the same hook through PluginHost.call with keyword arguments, trace on (the
                   path of hooks called once per run or job; the step's events are bound)

    python benchmarks/hook_cost.py [--calls 2000 12000]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import _cli
from callgrind import LAYOUT, per_step

PIECES = ("empty", "function call", "lock pair", "clock read", "noop body", "hook call",
          "hook call, trace", "serial call", "keyword call")


def loop(piece: str, n: int) -> None:
    """Run ``piece`` ``n`` times (what one callgrind process counts)."""
    from accelopt.host import PluginHost
    from accelopt.plugin import Registry

    spec = Registry.discover().get("noop")
    plugin = spec.instantiate()
    host = PluginHost([(spec, plugin)])
    host.trace = [] if piece in ("hook call, trace", "serial call", "keyword call") else None
    # the serial call is the one-job step's: no lock, its answer (None) dropped, no list
    serial = piece == "serial call"
    start = host.bound("accelopt_iteration_start", serial=serial, answers=not serial)
    lock = threading.RLock()
    clock = time.perf_counter

    def nothing(context: object) -> None:
        return None

    if piece == "empty":
        for _ in range(n):
            pass
    elif piece == "function call":
        for _ in range(n):
            nothing(None)
    elif piece == "lock pair":
        for _ in range(n):
            lock.acquire()
            lock.release()
    elif piece == "clock read":
        for _ in range(n):
            clock()
    elif piece == "noop body":
        for _ in range(n):
            plugin.accelopt_iteration_start(None)
    elif piece in ("hook call", "hook call, trace", "serial call"):
        assert start is not None
        for _ in range(n):
            start(None)
    elif piece == "keyword call":
        for _ in range(n):
            host.call("accelopt_iteration_start", context=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=_cli.summary(__doc__))
    parser.add_argument("--calls", nargs=2, type=_cli.positive_int, default=(2000, 12000),
                        metavar=("SHORT", "LONG"))
    parser.add_argument("--piece", choices=PIECES, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=_cli.nonnegative_int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.piece and args.n is None:
        parser.error("--piece needs --n")
    if not args.calls[0] < args.calls[1]:
        parser.error(f"--calls SHORT LONG: SHORT must be below LONG; got {args.calls[0]} {args.calls[1]}")
    if args.piece:
        loop(args.piece, args.n)
        return
    short, long = args.calls
    per_call = per_step(PIECES, lambda piece, n: [sys.executable, __file__, "--piece", piece,
                                                  "--n", str(n)], short, long)
    print(f"python {sys.version.split()[0]}; callgrind, {LAYOUT}; loops of {short} and {long} "
          "calls per piece; instructions per call, the empty loop's own subtracted")
    for piece in PIECES[1:]:
        print(f"  {piece:<18}{per_call[piece] - per_call['empty']:>8,.0f}")


if __name__ == "__main__":
    _cli.run(main)
