"""GPU check for tictac (well under a minute on one CUDA GPU; skips cleanly without CUDA).

What only a GPU shows: the time oracle on real kernels (each fx node timed with a CUDA
synchronise around it, minimum over runs) and the plan built from it. Verifies:

1. the oracle measured every forward op of the zoo's branched ``inception`` and a ResNet on
   CUDA, with positive times and a positive backward time;
2. the CUDA op times differ from the CPU ones (the oracle is per device: the cache key
   carries the device);
3. TIC and TAC give permutations of the parameters, the simulator's makespan lies between
   max(Mc, Pc) and Mc + Pc, and TAC is never predicted slower than the named order;
4. a real ResNet-152 built on CUDA (weights allocated) traces to the same DAG as the meta
   one the simulator uses.

    python benchmarks/gpu/tictac_check.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _cli
import _cli  # noqa: E402


def main() -> int:
    # before the CUDA check: --help shows what the check does, and a mistyped option is
    # refused here instead of starting the whole check on a GPU
    argparse.ArgumentParser(description=_cli.summary(__doc__)).parse_args()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (tictac GPU check needs one)")
        return 0
    from accelopt_plugins.tictac.dag import build_dag
    from accelopt_plugins.tictac.meta_models import META_MODELS, build_meta
    from accelopt_plugins.tictac.plan import plan_measured

    from accelopt.workloads.models import build_model

    failures: list[str] = []
    for name in ("inception", "resnet"):
        torch.manual_seed(0)
        cpu_model = build_model(name, input_shape=(3, 32, 32), num_classes=10, width=32)
        x = torch.randn(64, 3, 32, 32)
        cpu = plan_measured(cpu_model, x, name=name, kind="train", bytes_per_s=1e9, runs=3)
        gpu_model = build_model(name, input_shape=(3, 32, 32), num_classes=10, width=32).cuda()
        gpu = plan_measured(gpu_model, x.cuda(), name=name, kind="train", bytes_per_s=1e9,
                            runs=5, device="cuda")
        fwd = gpu.compute.forward
        if not fwd or min(fwd.values()) <= 0 or gpu.compute.backward_s <= 0:
            failures.append(f"{name}: oracle times not positive on CUDA")
        if fwd == cpu.compute.forward:
            failures.append(f"{name}: CUDA times equal CPU times")
        from accelopt_plugins.tictac.plan import with_ratio

        plan = with_ratio(gpu, 1.0)
        pred = plan.predict(("tac", "tic", "named", "random"), samples=200)
        sim = plan.sim
        for h in ("tac", "tic"):
            if sorted(plan.orders[h]) != list(range(len(plan.dag.recvs))):
                failures.append(f"{name}: {h} is not a permutation")
        for h, v in pred.items():
            if not (max(sim.mc, sim.pc) - 1e-12 <= v["makespan_s"] <= sim.mc + sim.pc + 1e-12):
                failures.append(f"{name}: {h} makespan outside the bounds")
        if pred["tac"]["makespan_s"] > pred["named"]["makespan_s"] * (1 + 1e-9):
            failures.append(f"{name}: TAC predicted slower than named")
        print(f"{name}: CUDA forward {1e3 * sum(fwd.values()):.3f} ms, backward "
              f"{1e3 * gpu.compute.backward_s:.3f} ms; predicted ms " + ", ".join(
                  f"{h} {1e3 * v['makespan_s']:.3f}" for h, v in pred.items())
              + f"; bound (compute alone, every transfer hidden) "
              f"{1e3 * (sum(fwd.values()) + gpu.compute.backward_s):.3f} ms")
    meta, _ = build_meta("resnet152")
    factory, _shape = META_MODELS["resnet152"]
    with torch.device("cuda"):
        real = factory()
    if build_dag(meta, "r152").fingerprint() != build_dag(real, "r152").fingerprint():
        failures.append("resnet152: CUDA and meta DAGs differ")
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else f"FAIL ({len(failures)} problems)")
    return 0 if not failures else 1


if __name__ == "__main__":
    _cli.run(main)
