"""The command a bench report shows (bench.md's ``Command:``, bench.json's
``context.command``) pastes back into a shell as the same command."""

from __future__ import annotations

import re
import shlex

from accelopt.bench.analysis import SetResult, summarize
from accelopt.bench.render import render_markdown
from accelopt.bench.runner import command_line

ARGS = ["--plugins", "noop", "--repeats", "3", "--metric", "avg_jct_s", "--out", "bench out",
        "workload=tiny", "+plugins.clip.max_norm=1", "run.name=it's"]


def test_the_command_is_shell_quoted():
    line = command_line(ARGS)
    assert shlex.split(line) == ["accelopt", "bench", *ARGS]
    assert "--out 'bench out' workload=tiny" in line


def test_the_report_shows_it_as_it_pastes_back():
    summary = summarize([SetResult((), (10.0, 9.0, 11.0)),
                         SetResult(("noop",), (10.0, 9.0, 11.0))], "avg_jct_s")
    for args in (ARGS, ["--out", "a`b", "workload=tiny"]):
        context = {"metric": "avg_jct_s", "command": command_line(args), "machine": "m",
                   "python": "3", "repeats": 3, "higher_is_better": False}
        (shown,) = [ln for ln in render_markdown(summary, context).splitlines()
                    if ln.startswith("Command: ")]
        span = re.fullmatch(r"Command: (`+) ?(.*?) ?\1", shown)
        assert span is not None, shown
        assert shlex.split(span.group(2)) == ["accelopt", "bench", *args]
