"""What plugin authors import in their tests: run a real tiny job under a plugin, record
the hook calls it saw, and check the plugin against the conformance suite.

    from accelopt.testing import HookRecorder, PluginConformance, run_workload

    class TestMyPlugin(PluginConformance):   # one pytest test per conformance check
        spec = PLUGIN

    def test_counts_iterations(tmp_path):
        recorder = HookRecorder()
        record = run_workload([PLUGIN], tmp_path=tmp_path, recorder=recorder)
        recorder.assert_order(["run_start", "iteration_end", "run_end"])

See ``docs/plugin-guide.md``.
"""

from __future__ import annotations

from accelopt.records import RunRecord
from accelopt.testing.conformance import (
    PluginConformance,
    check_config,
    check_declarations,
    check_hookimpls,
    check_no_retained_job_state,
    check_run,
    check_spec,
    conformance,
)
from accelopt.testing.harness import run_workload
from accelopt.testing.recorder import (
    LAUNCHER,
    RECORDER_NAME,
    HookCall,
    HookRecorder,
    Shipped,
    hook_names,
)

__all__ = [
    "LAUNCHER",
    "RECORDER_NAME",
    "HookCall",
    "HookRecorder",
    "PluginConformance",
    "RunRecord",
    "Shipped",
    "check_config",
    "check_declarations",
    "check_hookimpls",
    "check_no_retained_job_state",
    "check_run",
    "check_spec",
    "conformance",
    "hook_names",
    "run_workload",
]
