"""What the forkserver imports before it forks the first rank (``processes.PRELOAD``).

The runtime, and dynamo, which ``torch.optim`` imports when a job builds its optimizer and
when it steps (``add_param_group`` is wrapped in ``torch._disable_dynamo``): 1.8 s of CPU
that every rank would otherwise repeat.

With the cyclic garbage collector off while importing, then every imported object frozen
(Python's documented recipe for a process that forks without exec: ``gc.disable()`` early,
``gc.freeze()`` before forking). Why: importing torch and dynamo creates ~490,000
objects, which set off full collections that scan all of them again and again (~0.5 s of
this process's preload, the start-up's critical path); and in a rank every full collection
would scan them once more (one such collection while rank 0 unpickled the gathered results
took 0.24 s), although none of them is ever garbage. Frozen, a rank's collections scan only
what the rank made itself.
"""

from __future__ import annotations

import gc

from accelopt.collector import collector_paused

with collector_paused():
    import torch._dynamo  # noqa: F401

    import accelopt.drivers.cluster.launch  # noqa: F401
gc.freeze()
