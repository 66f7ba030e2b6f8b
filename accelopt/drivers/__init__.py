"""Drivers: what runs a workload's jobs. The local driver (``local.py``: the executor and its
lanes, one device) and the cluster driver (``cluster/``: ranks on torch.distributed, the
leader deciding with the same local driver). Both run the same ``Job.step`` and the same
``choose_next``; ``lifecycle.py`` is the run's lifecycle, implemented once for both."""
