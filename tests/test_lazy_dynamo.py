"""``accelopt.drivers.lazy_dynamo``: torch's optimizers run without importing dynamo until
something else imports it, and from then on torch's own wrappers are back.

Each case runs in a fresh interpreter: the test session itself may have imported dynamo
already, and the change is once per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

TRAIN = """
import sys, types, gc
import torch
from accelopt.drivers import lazy_dynamo

def train(make_optimizer):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = make_optimizer(model.parameters())
    x, y = torch.randn(16, 6), torch.randn(16, 2)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    optimizer.load_state_dict(optimizer.state_dict())
    return [p.detach().clone() for p in model.parameters()]

MAKERS = [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
          lambda p: torch.optim.Adam(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)]

def ours():
    return [f for f in gc.get_objects() if type(f) is types.FunctionType
            and f.__code__ is lazy_dynamo._use_grad_replacement()]
"""


def _run(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", TRAIN + textwrap.dedent(body)],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_optimizers_train_without_importing_dynamo_and_bitwise_as_torch_does():
    out = _run("""
        changed = lazy_dynamo.defer_dynamo_import()
        assert changed > 10, changed
        assert lazy_dynamo.defer_dynamo_import() == 0  # once per process
        deferred = [train(make) for make in MAKERS]
        assert "torch._dynamo" not in sys.modules
        assert ours()  # the optimizers' step wrappers run the dynamo-free code

        import torch._dynamo  # anything importing dynamo puts torch's wrappers back
        assert not ours()
        add = torch.optim.Optimizer.add_param_group.__wrapped__
        assert add.__dict__.get("__dynamo_disable") is not add
        assert not any(isinstance(f, lazy_dynamo._Restore) for f in sys.meta_path)
        for make, weights in zip(MAKERS, deferred):
            assert all(torch.equal(a, b) for a, b in zip(train(make), weights))
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_compiled_step_works_once_dynamo_is_imported():
    out = _run("""
        lazy_dynamo.defer_dynamo_import()
        train(MAKERS[1])  # eager first: the wrappers ran dynamo-free
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        @torch.compile(backend="eager")
        def step(x):
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()

        before = model.weight.detach().clone()
        step(torch.ones(2, 4))
        assert not torch.equal(before, model.weight)
        assert "torch._dynamo" in sys.modules and not ours()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_torch_whose_wrappers_look_different_is_left_alone():
    out = _run("""
        lazy_dynamo._disable_dynamo_code = lambda: None
        lazy_dynamo._use_grad_code = lambda: None
        assert lazy_dynamo.defer_dynamo_import() == 0
        assert not ours() and not any(isinstance(f, lazy_dynamo._Restore) for f in sys.meta_path)
        train(MAKERS[0])
        assert "torch._dynamo" in sys.modules  # torch imported it, as it always does
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_frozen_heap_is_scanned_too():
    """The ``accelopt`` command freezes its imports (``gc.freeze``) before the run sets torch
    up; ``gc.get_objects()`` leaves frozen objects out, and a scan that missed torch's
    wrappers would let the first optimizer import dynamo (~1 s)."""
    out = _run("""
        gc.freeze()
        frozen = gc.get_freeze_count()
        assert lazy_dynamo.defer_dynamo_import() > 10
        assert gc.get_freeze_count() >= frozen  # frozen again after the scan
        train(MAKERS[0])
        assert "torch._dynamo" not in sys.modules
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_command_trains_without_importing_dynamo(tmp_path):
    """What the two above protect, end to end: ``accelopt run`` (its collector paused over
    the imports, then frozen) trains a one-process run and never imports dynamo."""
    code = textwrap.dedent(f"""
        import sys
        from accelopt.cli.main import main
        try:
            main(["run", "workload=tiny", "cluster.mode=none", "run.progress=false",
                  "hydra.run.dir={tmp_path / 'run'}"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        print("dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=110)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "dynamo imported: False"
    assert (tmp_path / "run" / "timeline.png").is_file()
