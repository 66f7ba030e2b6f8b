"""Gaps a plugin author found working from the docs only: a ``TransferRecord`` field the
reference named wrong (``job`` for ``job_id``), a kept gradient tensor the retention check
missed, ``HookRecorder`` rank tags that differed between a one-process and a cluster run,
and a gpu_kernels hint inviting a value its config refuses."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from test_testing_kit import ONE_JOB, Counter, make_spec  # the kit's minimal correct plugin

from accelopt import IterationContext, hookimpl
from accelopt import types as records
from accelopt.testing import (
    LAUNCHER,
    HookRecorder,
    check_no_retained_job_state,
    check_run,
    run_workload,
)
from accelopt.types import TransferRecord

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# --- 1. the record fields the docs list ---------------------------------------------------

RECORDS = {name: cls for name, cls in vars(records).items()
           if isinstance(cls, type) and dataclasses.is_dataclass(cls)
           and cls.__module__ == records.__name__}
"""The records a hook passes or takes (``accelopt.types``), by name."""
_LISTED = re.compile(
    rf"`({'|'.join(sorted(RECORDS, key=len, reverse=True))})(?:`\s*\(|\()([^()]*)\)")
"""A record with a parenthesised list: ``\\`TransferRecord\\` (job_id, ...)`` in prose or
``\\`TransferRecord(job_id, ...)\\``` in code."""
_FIELD = re.compile(r"([a-z_][a-z0-9_]*)(?:\s*=|\s|$)")


def listed_fields(text: str) -> list[tuple[str, list[str]]]:
    """(record, the field names listed) for every parenthesised list after a record's name
    in ``text`` whose first item is a bare name (``job_id``, ``granted=True``): a field
    list, not a remark such as ``CliCommand`` (the others' ...). Each item's leading name
    is its field (``kind `param`/`grad```: kind; ``and `wire_bytes` once ...``: wire_bytes)."""
    found = []
    for match in _LISTED.finditer(" ".join(text.split())):
        items = [i.strip().removeprefix("and ").replace("`", "").strip()
                 for i in match.group(2).split(",")]
        if not items or not re.fullmatch(r"[a-z_][a-z0-9_]*(\s*=.*)?", items[0]):
            continue
        found.append((match.group(1), [m.group(1) for i in items
                                       if (m := _FIELD.match(i + " "))]))
    return found


def _fields(record: str) -> set[str]:
    return {f.name for f in dataclasses.fields(RECORDS[record])}


def test_hooks_md_lists_exactly_the_transfer_record_fields() -> None:
    """It listed ``job``: a plugin reading ``record.job`` crashed, in cluster runs only."""
    section = (DOCS / "hooks.md").read_text().split("## Send / recv", 1)[1]
    listed = [fields for record, fields in listed_fields(section) if record == "TransferRecord"]
    assert listed, "docs/hooks.md: '## Send / recv' no longer lists TransferRecord's fields"
    assert listed[0] == [f.name for f in dataclasses.fields(TransferRecord)], (
        f"docs/hooks.md lists TransferRecord as ({', '.join(listed[0])}); its fields are "
        f"({', '.join(f.name for f in dataclasses.fields(TransferRecord))})")
    assert "`JobInfo.job_id`" in section.split("###", 1)[0]  # which job field it equals


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_record_field_a_page_lists_is_a_field(page: str) -> None:
    for record, names in listed_fields((DOCS / page).read_text()):
        unknown = [n for n in names if n not in _fields(record)]
        assert not unknown, (f"docs/{page}: {record} has no field {', '.join(unknown)} "
                             f"(its fields: {', '.join(sorted(_fields(record)))})")


def test_the_field_list_reader_reads_what_the_docs_write() -> None:
    assert listed_fields("a `TransferRecord` (job, iteration, kind `param`/`grad`, and "
                         "`wire_bytes` once sent); a `CliCommand` (the others' commands)"
                         " and `AllocationDecision(granted=True, lane=L)`") == [
        ("TransferRecord", ["job", "iteration", "kind", "wire_bytes"]),
        ("AllocationDecision", ["granted", "lane"])]


# --- 2. a kept gradient tensor ------------------------------------------------------------


GRADIENT_KEPT = (r"still holds a job's gradient tensor \(gradients\[name\] and p\.grad are "
                 r"the job's live gradient buffers, reused every iteration; keep a \.clone\(\) "
                 r"or a number such as its norm\) at GradKeeper\.kept")


def _grad_keeper(keep: Any) -> type:
    class GradKeeper(Counter):
        def __init__(self, config: Any = None) -> None:
            super().__init__(config)
            self.kept: Any = None

        @hookimpl
        def accelopt_before_optimizer_step(self, context: IterationContext,
                                           gradients: Any) -> None:
            self.kept = keep(gradients)

    return GradKeeper


@pytest.mark.parametrize("keep, where", [
    (lambda g: next(iter(g.values())), ""),
    (lambda g: {name: g[name][:1] for name in g}, r"\['"),  # a view of each
], ids=["one-gradient", "views"])
def test_a_plugin_keeping_a_gradient_tensor_fails_the_retention_check(
        tmp_path: Path, keep: Any, where: str) -> None:
    spec = make_spec(_grad_keeper(keep))
    with pytest.raises(AssertionError, match=rf"plugin 'counter': after the run it "
                                             rf"{GRADIENT_KEPT}{where}"):
        check_no_retained_job_state(spec, check_run(spec, tmp_path))


def test_a_numpy_view_of_a_gradient_fails_the_retention_check(tmp_path: Path) -> None:
    spec = make_spec(_grad_keeper(lambda g: next(iter(g.values())).numpy()))
    with pytest.raises(AssertionError, match=r"still holds a ndarray viewing a job's "
                                             r"gradient .* at GradKeeper\.kept"):
        check_no_retained_job_state(spec, check_run(spec, tmp_path))


def test_a_plugin_keeping_copies_or_numbers_of_the_gradients_passes(tmp_path: Path) -> None:
    spec = make_spec(_grad_keeper(lambda g: ({n: t.clone() for n, t in g.items()},
                                             float(g.norm()))))
    instances = check_run(spec, tmp_path)
    check_no_retained_job_state(spec, instances)
    assert any(i.kept for i in instances)  # it did keep its copies


# --- 3. the recorder's rank tags in every mode --------------------------------------------


def test_a_one_process_run_tags_the_validation_as_the_launcher(tmp_path: Path) -> None:
    """Its validation's configure was rank 0's: ``count("configure", rank=0)`` was 2 with
    cluster.mode=none and 1 with ps."""
    recorder = HookRecorder()
    record = run_workload(["noop"], tmp_path=tmp_path, recorder=recorder)
    assert [j.status for j in record.jobs] == ["done", "done"]
    assert recorder.ranks() == [LAUNCHER, 0]
    assert recorder.count("configure", rank=0) == recorder.count("configure", rank=LAUNCHER) == 1
    assert recorder.count("configure") == 2  # without rank: the validation's too
    assert recorder.names(rank=LAUNCHER) == ["accelopt_configure"]
    (run_config,) = recorder.calls("configure", rank=0)
    assert run_config is recorder.calls("configure")[1]  # the run's is the later one
    recorder.assert_order(["configure", "layer_build", "run_start", "iteration_end",
                           "run_end"], rank=0)


@pytest.mark.timeout(180)
def test_a_ps_run_tags_the_same_and_its_transfers_carry_the_job_id(tmp_path: Path) -> None:
    recorder = HookRecorder()
    record = run_workload(["noop"], [*ONE_JOB, "cluster.mode=ps"], tmp_path=tmp_path,
                          recorder=recorder)
    assert [j.status for j in record.jobs] == ["done"]
    assert recorder.count("configure", rank=0) == 1  # as in cluster.mode=none
    # TransferRecord.job_id is JobInfo.job_id (docs/hooks.md), not JobInfo.name
    job = recorder.calls("iteration_start", rank=1)[0]["context"].job
    sent = {c["record"].job_id for c in recorder.calls("transfer_done", rank=1)}
    assert sent == {job.job_id} == {"00-m"} and job.name == "m"


# --- 4. the gpu_kernels hint's example values ---------------------------------------------


def test_every_setting_the_gpu_kernels_hint_shows_is_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It said ``set ... tiled_linear or channels_last``: ``tiled_linear=true`` is refused
    (a mode: off, tiled, register_blocked)."""
    from accelopt_plugins.gpu_kernels import PLUGIN

    from accelopt.activation import plugin_config
    from accelopt.cli.hydra_run import compose_checked
    from accelopt.config import register_plugin_configs, register_schema

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # conv_autotune's cache directory
    (row,) = PLUGIN.instantiate().accelopt_report_rows(run=None)
    hint = row.summary.split("set plugins.gpu_kernels.", 1)[1]
    settings = [s.strip() for s in re.split(r",| or ", hint)]
    assert {s.split("=")[0] for s in settings} == {
        "prune_amount", "conv_autotune", "tiled_linear", "channels_last"}
    register_schema()
    register_plugin_configs([PLUGIN])
    for setting in settings:
        assert re.fullmatch(r"\w+=\S+", setting), f"the hint shows no value: {setting!r}"
        cfg = compose_checked(["workload=tiny", "+plugins=[gpu_kernels]",
                               f"plugins.gpu_kernels.{setting}"])
        plugin = PLUGIN.instantiate(plugin_config(PLUGIN, cfg))
        plugin.accelopt_configure(plugin.config, cfg)  # validates, as a run does
        assert plugin.enabled, setting
