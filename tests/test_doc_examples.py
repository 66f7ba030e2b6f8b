"""The plugin code the docs show runs, in every cluster mode (datasette-style: the docs are the
source, this test parses them).

``docs/hooks.md`` and ``docs/plugin-guide.md`` promise that a hook written once works in a
one-process run, a parameter-server cluster and an all-reduce cluster, and their examples
are what authors copy. Each ``python`` block that is a hook implementation (it starts with
``@hookimpl``) becomes a method of a plugin class built here from the page; each block that
is a whole plugin (a class and ``PLUGIN = PluginSpec(...)``) is run as it is. Every one of
them runs the tiny workload in ``cluster.mode=none``, ``ps`` and ``allreduce``: an example
that raises there, or leaves a job unfinished, fails here instead of in a reader's plugin.

An example reads attributes its plugin would have set up (``self.free``, ``self.max_norm``)
and names helpers of its own (``prune``, ``Lookahead``): :class:`DocExample` gives those
attributes values under which every example runs its common path, and :data:`NAMESPACE`
gives the helpers stand-ins. An example reading a new one fails with ``NameError`` or
``AttributeError``: add it there.

The plugin classes are built when this module is imported, so a cluster run's rank
processes (which import it to unpickle the specs they are sent) build the same ones.
"""

from __future__ import annotations

import copy
import math
import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from accelopt import (
    AllocationDecision,
    CliCommand,
    OptimizerRebuild,
    PluginSpec,
    ReportRow,
    TransferPriorities,
    UserError,
    hookimpl,
)
from accelopt.drivers.rows import SILENT_SUMMARY
from accelopt.testing import run_workload

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/hooks.md", "docs/plugin-guide.md")
MODES = ("none", "ps", "allreduce")
PLUGIN_NAME = "myplugin"
"""The name the examples give their plugin (``ReportRow("myplugin", ...)``)."""
OWN_PLUGIN = {"accelopt_allocate": "alloc", "accelopt_release": "alloc"}
"""Hooks whose examples run in a plugin of their own: the allocation example gives every
job a lane of its own, so next to it ``accelopt_select_next`` (two ready jobs in one lane)
would never be called."""
WORKLOAD = ("workload.jobs=[{name: a, model: mlp, width: 8, batch_size: 8, iterations: 3}, "
            "{name: b, model: cnn, width: 4, batch_size: 8, iterations: 2}]",
            "cluster.workers=2", "cluster.timeout_s=60")
"""Two jobs arriving together in one lane (so ``accelopt_select_next`` is asked), a few
iterations each, two workers in a cluster mode."""


def _blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return [textwrap.dedent(b) for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)]


def hook_examples(page: str) -> list[str]:
    """The blocks of ``page`` that are hook implementations (one or several)."""
    return [b for b in _blocks(page) if re.match(r"@hookimpl\s*\ndef accelopt_\w+\(", b.lstrip())]


def whole_plugins(page: str) -> list[str]:
    """The blocks of ``page`` that define a plugin class and its ``PLUGIN`` spec."""
    return [b for b in _blocks(page)
            if re.search(r"^class \w+", b, re.M) and re.search(r"^PLUGIN = PluginSpec\(", b, re.M)]


def _stand_in(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a docs example's helper ran; DocExample's settings should avoid it")


NAMESPACE: dict[str, Any] = {
    "copy": copy, "math": math, "torch": torch, "Path": Path,
    "AllocationDecision": AllocationDecision, "CliCommand": CliCommand,
    "OptimizerRebuild": OptimizerRebuild, "PluginSpec": PluginSpec, "ReportRow": ReportRow,
    "TransferPriorities": TransferPriorities, "UserError": UserError, "hookimpl": hookimpl,
    # helpers the examples only name (DocExample's settings keep them from running)
    "plan_order": lambda traced, inputs: None, "prune": _stand_in, "Lookahead": _stand_in,
    "SampledSoftmaxLinear": _stand_in,
}


@dataclass
class DocConfig:
    """The settings the examples read from ``config`` / ``self.config``."""

    policy: str = "srtf"
    max_norm: float = 1.0
    norm_type: float = 2.0
    skip_non_finite: bool = True


class DocExample:
    """What an example's plugin would have set up before its hooks run."""

    def __init__(self, config: DocConfig) -> None:
        self.config = config
        self.started: dict[str, float] = {}
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.bandwidth: list[float] = []
        self.n = 0
        self.scale = 1.0
        self.max_norm = 1.0
        self.free = 1 << 40
        self.granted: dict[str, int] = {}
        self.residual: dict[str, Any] = {}
        self.lookahead_jobs: tuple[str, ...] = ()
        self.prune_at = -1  # never: pruning needs a model the example does not keep
        self.min_width = 1 << 30  # no layer is replaced
        self.min_bytes = 0
        self.steps = 0


def _example_classes() -> dict[str, type]:
    """One plugin class per page and group of examples: a block goes to the first group that
    has none of its hooks yet (two ``accelopt_transfer_order`` answers would hide each
    other), the hooks of :data:`OWN_PLUGIN` to groups of their own."""
    classes: dict[str, type] = {}
    for page in PAGES:
        stem = Path(page).stem.replace("-", "_")
        groups: dict[str, dict[str, Any]] = defaultdict(dict)
        for n, source in enumerate(hook_examples(page)):
            namespace = dict(NAMESPACE)
            exec(compile(source, f"{page}:example{n}", "exec"), namespace)  # noqa: S102
            hooks = {k: v for k, v in namespace.items() if k.startswith("accelopt_")}
            kind = OWN_PLUGIN.get(next(iter(hooks)), "")
            index = next(i for i in range(len(groups) + 1)
                         if not set(hooks) & set(groups.get(f"{kind}{i}", ())))
            groups[f"{kind}{index}"].update(hooks)  # a block's hooks stay together
        for key, methods in groups.items():
            classes[f"{stem}_{key}"] = type(f"{stem}_{key}", (DocExample,), dict(methods))
        for n, source in enumerate(whole_plugins(page)):
            namespace = dict(NAMESPACE, __name__=__name__)
            exec(compile(source, f"{page}:plugin{n}", "exec"), namespace)  # noqa: S102
            classes[f"{stem}_plugin{n}"] = namespace["PLUGIN"].factory
    for name, cls in classes.items():  # picklable by reference, for the ranks
        cls.__module__, cls.__qualname__, cls.__name__ = __name__, name, name
        globals()[name] = cls
    return classes


EXAMPLES = _example_classes()


def test_the_pages_have_examples_to_run():
    assert {"hooks_0", "hooks_1", "hooks_alloc0", "hooks_plugin0", "plugin_guide_0"} <= set(EXAMPLES)
    assert "accelopt_select_next" in vars(EXAMPLES["hooks_0"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_docs_example_runs_in_every_mode(example: str, mode: str, tmp_path: Path) -> None:
    cls = EXAMPLES[example]
    config = DocConfig if issubclass(cls, DocExample) else None
    spec = PluginSpec(name=PLUGIN_NAME, factory=cls, description=f"docs example {example}",
                      **({"config": config} if config else {}))
    record = run_workload([spec], [*WORKLOAD, f"cluster.mode={mode}"], tmp_path=tmp_path)
    unfinished = [f"{j.job.name}: {j.status} {j.error or ''}" for j in record.jobs
                  if j.status != "done"]
    assert not unfinished, f"{example} in cluster.mode={mode}: {unfinished}"
    if hasattr(cls, "accelopt_report_rows"):  # it says what it did, in every mode
        own = [r.summary for r in record.plugin_rows if r.plugin == PLUGIN_NAME]
        assert own and SILENT_SUMMARY not in own, (
            f"{example} in cluster.mode={mode}: its report rows are {own}")
