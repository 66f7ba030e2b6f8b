"""What the forkserver imports before it forks the first rank of an all-reduce run
(``processes.PRELOAD_DDP``): dynamo, then everything :mod:`accelopt.drivers.rank_preload`
imports.

Why dynamo here: every all-reduce rank wraps its model in ``DistributedDataParallel``, whose
constructor imports ``torch._dynamo`` (~1.1 s of CPU). Imported once here, with the
collector paused and then frozen with the rest, it is not imported again in each rank,
where two ranks on two cores would each pay it (0.8 s more start-up, paired, in
``benchmarks/startup.py cluster.mode=allreduce``) and every collection would scan it.
"""

from __future__ import annotations

import signal

_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as rank_preload: no traceback on Ctrl-C
try:
    from accelopt.drivers.processes import quiet_cpp_warnings

    quiet_cpp_warnings()  # before torch: it reads the level when imported

    from accelopt.collector import collector_paused

    with collector_paused():
        import torch._dynamo  # noqa: F401

    import accelopt.drivers.rank_preload  # noqa: F401  (freezes everything imported)
finally:
    signal.signal(signal.SIGINT, _sigint)
