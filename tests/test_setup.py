"""Process setup (``drivers/setup.py``): every process sets torch up the same way, cheaply."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CHECK = """
import sys, torch
from accelopt.drivers.setup import setup_torch
setup_torch({"seed": 3, "threads": 1, "deterministic": True})
assert torch.are_deterministic_algorithms_enabled()
assert torch.is_deterministic_algorithms_warn_only_enabled()
assert torch.get_num_threads() == 1
assert "torch._inductor.config" not in sys.modules, "setup loaded the compiler"
import torch._inductor.config as inductor
assert inductor.deterministic, "inductor, loaded later, is deterministic too"
"""


def test_deterministic_setup_does_not_load_the_compiler_but_reaches_it():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
