"""What the forkserver imports before it forks the first rank (``processes.PRELOAD``).

Torch and the runtime, which every rank would otherwise import again; not dynamo, which
``torch.optim`` would import when a job builds its optimizer (``add_param_group`` is wrapped
in ``torch._disable_dynamo``): ~1.1 s more on the start's critical path for a compiler no
rank of a parameter-server run uses (:mod:`accelopt.drivers.lazy_dynamo`; an all-reduce
rank's ``DistributedDataParallel`` imports it).

With the cyclic garbage collector off while importing, then every imported object frozen
(Python's documented recipe for a process that forks without exec: ``gc.disable()`` early,
``gc.freeze()`` before forking). Why: an import of this size makes hundreds of thousands of
objects (~200,000 here, ~320,000 with dynamo), which set off full collections that scan
all of them again and again (with dynamo, ~0.5 s of this process's preload, the start-up's
critical path); and in a rank every full collection would scan them once more (one such
collection while rank 0 unpickled the gathered results took 0.24 s), although none of them
is ever garbage. Frozen, a rank's collections scan only what the rank made itself.
"""

from __future__ import annotations

import gc
import signal

# Ctrl-C reaches the whole process group; a forkserver still importing would print a
# KeyboardInterrupt traceback of its own beside the launcher's one line (the launcher stops
# the run and the forkserver with it). Python's forkserver ignores SIGINT only once its
# preload is done: ignore it here for the preload, then hand back what was there, also when
# an import fails (the forkserver passes over a preload's ImportError, and its ranks would
# otherwise start with Ctrl-C ignored).
_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    from accelopt.drivers.processes import quiet_cpp_warnings

    quiet_cpp_warnings()  # before torch: it reads the level when imported

    from accelopt.collector import collector_paused
    from accelopt.drivers.lazy_dynamo import defer_dynamo_import

    with collector_paused():
        import accelopt.drivers.cluster.launch  # noqa: F401

        defer_dynamo_import()
    gc.freeze()
finally:
    signal.signal(signal.SIGINT, _sigint)
