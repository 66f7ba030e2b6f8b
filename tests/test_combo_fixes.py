"""Combinations that must mean one thing: slide with gpu_kernels whatever the list order,
and ``accelopt bench --plugins`` measuring the valid sets of a mode that refuses some."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from accelopt.bench import runner
from accelopt.errors import UserError
from accelopt.plugin import Registry, resolve

pytestmark = pytest.mark.timeout(120)


def test_slide_and_gpu_kernels_resolve_to_one_order() -> None:
    """``+plugins=[slide,gpu_kernels]`` and ``[gpu_kernels,slide]`` built different models
    under one name; the spec's declared order makes them the same set."""
    registry = Registry.discover()
    orders = [[s.name for s in resolve(chosen, registry)]
              for chosen in (["slide", "gpu_kernels"], ["gpu_kernels", "slide"])]
    assert orders == [["slide", "gpu_kernels"], ["slide", "gpu_kernels"]]


def _bench_sets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str]
                ) -> list[list[str]]:
    """The sets ``accelopt bench args`` would sweep (the sweep itself replaced)."""
    seen: list[list[str]] = []

    def sweep(opts: Any, args: list[str], out: Path, created: bool, sets: list[list[str]],
              *rest: Any) -> int:
        seen.extend(sets)
        return 0

    monkeypatch.setattr(runner, "_bench", sweep)
    assert runner.bench_command([*args, "--out", str(tmp_path / "bench")]) == 0
    return seen


def test_bench_plugins_leaves_out_the_sets_this_mode_refuses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """``--plugins slide,gradcomm`` in an all-reduce cluster refused the whole bench for
    [slide], though the help promises "every valid combination" and [gradcomm] runs."""
    sets = _bench_sets(monkeypatch, tmp_path, ["--plugins", "slide,gradcomm", "--repeats", "1",
                                               "workload=xc", "cluster.mode=allreduce"])
    assert sets == [[], ["gradcomm"]]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("left out")]
    assert len(lines) == 1, err
    assert "[slide]" in lines[0] and "[gradcomm,slide]" in lines[0]
    assert "cluster.mode=none" in lines[0]


def test_bench_refuses_when_only_the_baseline_or_an_explicit_set_is_refused(
        tmp_path: Path) -> None:
    """Nothing but the baseline left is no comparison; a set named in --sets is the user's
    choice, so it still refuses in one line."""
    common = ["workload=xc", "cluster.mode=allreduce", "--out", str(tmp_path / "never")]
    with pytest.raises(UserError, match=r"^set \[slide\] cannot run: "):
        runner.bench_command(["--plugins", "slide", *common])
    with pytest.raises(UserError, match=r"^set \[slide\] cannot run: "):
        runner.bench_command(["--sets", "[],[gradcomm],[slide]", *common])
    assert not (tmp_path / "never").exists()
