"""vDNN feature-map offloading vs the run without it vs torch's save_on_cpu vs
torch.utils.checkpoint, on one VGG-16-shaped network, in one run.

Prints, side by side: the saved-activation bytes left on the compute device after forward
(what vDNN cuts), the bytes copied to the host, step time (median of --repeats timed steps
after warm-up), and whether the gradients are bitwise equal to the baseline's (else the
largest difference). Bytes and gradients come from one counted pass under the same hooks as
the timed steps. ``save_on_cpu`` copies each saved tensor into a contiguous buffer, so the
transposed Linear weights that ``addmm`` saves come back in another memory layout and the
matmuls of backward can round differently: its gradients may differ from the baseline's in
the last bits (vDNN offloads feature maps only, weights never).

On CUDA the activation memory is measured (``torch.cuda.max_memory_allocated`` during
forward+backward minus what was allocated before: parameters, gradients, optimizer state).
On a CPU there is no device memory to save: the figures are counted bytes (every saved
tensor passes through a counting hook), and the step times show the cost of the copies.

    python benchmarks/offload_compare.py
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import _cli
import torch
from accelopt_plugins.offload.engine import POLICIES, OffloadEngine, install_on
from torch import nn
from torch.utils.checkpoint import checkpoint

MiB = 2**20
VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


class VGG(nn.Module):
    """VGG-16 (Simonyan & Zisserman), channels divided by ``shrink``; ``segments`` are the
    five conv blocks (checkpoint boundaries)."""

    def __init__(self, shrink: int, image: int, classes: int = 10) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        layers: list[nn.Module] = []
        c = 3
        for v in VGG16:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                blocks.append(nn.Sequential(*layers))
                layers = []
            else:
                out = max(4, int(v) // shrink)
                layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(inplace=True)]
                c = out
        self.blocks = nn.Sequential(*blocks)
        side = image // 32
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(c * side * side, 256),
                                  nn.ReLU(inplace=True), nn.Linear(256, classes))
        self.checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointed:
                x = checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.head(x)


class Counter:
    """Counts the bytes of saved tensors (each storage once) as they are saved, split into
    parameters and activations, and the bytes a wrapped pack hook copied off them.

    Counting wraps the variant's own pack hook (``inner``; none: the tensor is kept as it is)
    instead of nesting a second hook around it: autograd runs only the innermost
    ``saved_tensors_hooks``, so an outer counting hook would replace the variant's own and
    the counted pass would compute other gradients than the timed steps."""

    def __init__(self, params: set[int],
                 inner: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.params, self.inner = params, inner
        self.seen: set[int] = set()
        self.activation_bytes = self.param_bytes = self.copied_bytes = 0
        self.resident_activation_bytes = 0
        """Activation bytes the pack hook left where they were (on the compute device)."""

    def pack(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        nbytes = t.numel() * t.element_size()
        packed = t if self.inner is None else self.inner(t)
        kept = _packed_tensor(packed)
        moved = kept is None or kept.untyped_storage().data_ptr() != ptr
        if moved:
            self.copied_bytes += nbytes
        if ptr in self.params:
            self.param_bytes += nbytes
        elif ptr not in self.seen:
            self.seen.add(ptr)
            self.activation_bytes += nbytes
            if not moved:
                self.resident_activation_bytes += nbytes
        return packed


def _packed_tensor(packed: Any) -> torch.Tensor | None:
    """The tensor a pack hook kept: the value itself, or the tensor in a ``(device, tensor)``
    pair (``save_on_cpu``'s form); None for any other form."""
    if isinstance(packed, torch.Tensor):
        return packed
    if isinstance(packed, tuple) and len(packed) == 2 and isinstance(packed[1], torch.Tensor):
        return packed[1]
    return None


class Variant:
    """One side of the comparison, set up once: its own copy of the model, its optimizer and
    (offload) its engine. :meth:`measure` makes the one counted pass (memory, copied bytes,
    gradients); :meth:`timed_step` is one plain step as a user would run it: no counting
    hook on any side, so the timed work is only the variant's own."""

    def __init__(self, name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 args: argparse.Namespace) -> None:
        self.name, self.model, self.x, self.y = name, model, x, y
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.engine = None
        if name == "offload (vDNN)":
            self.engine = OffloadEngine(policy=args.policy, prefetch_layers=args.prefetch)
            install_on(model, self.engine)
        if name == "checkpoint":
            model.checkpointed = True  # type: ignore[assignment]
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.times: list[float] = []

    def _step(self, hooks: Any) -> None:
        self.opt.zero_grad(set_to_none=False)
        inp = self.x.requires_grad_(self.name == "checkpoint")  # reentrant checkpoint needs it
        with hooks:
            out = self.model(inp)
        nn.functional.cross_entropy(out, self.y).backward()
        if self.engine is not None:
            self.engine.close_pass()  # as the plugin does at every iteration's end

    def _own_hooks(self) -> Any:
        """What the variant itself installs around forward (offload's engine is installed on
        the model; save_on_cpu is torch's own context manager).

        ``save_on_cpu`` with ``pin_memory=True`` on every device: with ``False`` its pack is
        ``tensor.cpu()``, which on a CPU returns the tensor itself, so the variant would copy
        nothing there and its row would repeat the baseline's. With ``True`` it copies each
        saved tensor into a fresh host buffer (pinned where CUDA exists), as on a GPU."""
        if self.name == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def _counted_hooks(self) -> tuple[Any, Counter | None]:
        """The variant's own hooks with a byte count around its pack hook (no engine: the
        engine's own hooks are the inner ones and it counts itself). The gradients of the
        counted pass are those of the timed steps: the same pack and unpack run."""
        if self.engine is not None:
            return contextlib.nullcontext(), None
        own = self._own_hooks()
        if isinstance(own, torch.autograd.graph.saved_tensors_hooks):
            counter = Counter(self.params, own.pack_hook)
            return torch.autograd.graph.saved_tensors_hooks(counter.pack, own.unpack_hook), \
                counter
        counter = Counter(self.params)
        return torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), counter

    def warm_up(self, steps: int) -> None:
        for _ in range(steps):
            self._step(self._own_hooks())
            self.opt.step()

    def measure(self) -> dict[str, Any]:
        """The counted pass: resident and copied bytes, peak memory on CUDA, gradients, all
        under the hooks the timed steps run."""
        device = self.x.device
        self.opt.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        hooks, counter = self._counted_hooks()
        resident_after_forward: list[int] = []
        probe = None
        if device.type == "cuda":

            def after_forward(_module: nn.Module, _args: Any, _out: Any) -> None:
                # What vDNN reduces: the feature maps held on the device between forward
                # and backward. Wait for the offload copies, then let the allocator retire
                # the blocks they freed (it does so on its next allocation) before reading.
                torch.cuda.synchronize()
                torch.empty(1, device=device)
                resident_after_forward.append(torch.cuda.memory_allocated() - base)

            probe = self.model.register_forward_hook(after_forward)
        if self.engine is not None:
            self.engine.totals = type(self.engine.totals)()  # count this pass only
        self._step(hooks)
        if probe is not None:
            probe.remove()
        grads = [p.grad.detach().clone() for p in self.model.parameters()]
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        if self.engine is not None:
            s = self.engine.totals.stats
            n = max(1, self.engine.totals.passes)
            resident, copied = s.resident_bytes // n, s.offloaded_bytes // n
        else:
            assert counter is not None
            resident, copied = counter.resident_activation_bytes, counter.copied_bytes
        return {"name": self.name, "resident": resident, "copied": copied, "peak": peak,
                "after_forward": resident_after_forward[0] if resident_after_forward else None,
                "grads": grads}

    def timed_step(self) -> None:
        sync = torch.cuda.synchronize if self.x.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        self._step(self._own_hooks())
        sync()
        self.times.append(time.perf_counter() - t0)


def grads_verdict(grads: list[torch.Tensor], base: list[torch.Tensor]) -> str:
    """``bitwise equal``, or ``differ`` with the largest absolute difference: a last-bit
    change (a saved tensor copied into another memory layout, which changes the order of a
    matmul's sums) reads differently from a wrong gradient."""
    if all(torch.equal(a, b) for a, b in zip(grads, base, strict=True)):
        return "bitwise equal"
    worst = max(float((a.double() - b.double()).abs().max()) for a, b in
                zip(grads, base, strict=True))
    return f"differ (max |diff| {worst:.1e})"


def copy_bandwidth(device: torch.device, nbytes: int = 64 * MiB, repeats: int = 5) -> float:
    """Bytes per second of one copy from the compute device to host memory (pinned on
    CUDA; on a CPU a memcpy within the same RAM), median of ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


NAMES = ("baseline", "offload (vDNN)", "save_on_cpu", "checkpoint")


def compare(reference: nn.Module, x: torch.Tensor, y: torch.Tensor,
            args: argparse.Namespace, names: tuple[str, ...] = NAMES) -> list[dict[str, Any]]:
    """Every variant on its own copy of ``reference``: warm-up, one counted pass each, then
    ``args.repeats`` interleaved timed rounds. One result dict per variant, in ``names``
    order (``step_s``: median; ``spread``: min and max)."""
    variants = [Variant(name, copy.deepcopy(reference).to(x.device), x.clone(), y, args)
                for name in names]
    for v in variants:
        v.warm_up(args.warmup)
    results = [v.measure() for v in variants]
    # timed rounds: one step of every variant per round, the order rotating between rounds,
    # so a busy moment of the machine slows every variant alike
    for r in range(args.repeats):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            v.timed_step()
    for v, res in zip(variants, results, strict=True):
        res["step_s"] = statistics.median(v.times)
        res["spread"] = (min(v.times), max(v.times))
    return results


def change(fraction: float, signed: bool = True) -> str:
    """A relative change as a whole percentage (with its sign unless ``signed`` is false);
    one that rounds to zero is ``+0%`` (``0%``), never ``-0%``: the baseline's change
    against itself is -0.0 (``-(1 - 1)``), and a tiny negative change rounds to ``-0%``,
    which reads as a cut."""
    text = f"{fraction:+.0%}" if signed else f"{fraction:.0%}"
    return text.replace("-0%", "+0%" if signed else "0%") if text.lstrip("+-") == "0%" else text


def _device(text: str) -> str:
    """``cpu`` or a CUDA device this machine has (``cuda``, ``cuda:1``): a usage error
    otherwise (``cuda`` without one was torch's AssertionError, after the model was built)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu or cuda[:N]") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: this benchmark runs on cpu or cuda[:N]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available on this "
                                             "machine; use --device cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=_cli.summary(__doc__))
    ap.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shrink", type=_cli.positive_int, default=4, help="VGG-16 channels divided by this")
    ap.add_argument("--image", type=_cli.positive_int, default=64)
    ap.add_argument("--batch", type=_cli.positive_int, default=16)
    ap.add_argument("--policy", default="all", choices=POLICIES)
    ap.add_argument("--prefetch", type=_cli.nonnegative_int, default=1)
    ap.add_argument("--warmup", type=_cli.nonnegative_int, default=2)
    ap.add_argument("--repeats", type=_cli.positive_int, default=15)
    ap.add_argument("--threads", type=_cli.nonnegative_int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    reference = VGG(args.shrink, args.image)
    x = torch.randn(args.batch, 3, args.image, args.image, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    results = compare(reference, x, y, args)
    bandwidth = copy_bandwidth(device)
    base = results[0]
    print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"device {device}" + (f" ({torch.cuda.get_device_name(device)})"
                                if device.type == "cuda" else ""))
    print(f"model: VGG-16 channels/{args.shrink}, {args.image}x{args.image} images, batch "
          f"{args.batch}; offload policy {args.policy}, prefetch {args.prefetch} layer(s); "
          f"step time = median of {args.repeats} interleaved rounds (one step of every "
          f"variant per round, order rotating) after {args.warmup} warm-up steps each; no "
          "counting hook on any timed step (bytes come from one separate counted pass)")
    if device.type != "cuda":
        print("cpu: no device memory exists; 'resident' counts saved-activation bytes the "
              "autograd graph keeps on the compute device (what would stay in GPU memory)")
    header = (f"{'variant':<16}{'resident MiB':>13}{'vs base':>9}{'to host MiB':>12}"
              f"{'peak MiB':>10}{'step ms':>9}{'vs base':>9}  grads")
    print(header)
    print("-" * len(header))
    for r in results:
        verdict = grads_verdict(r["grads"], base["grads"])
        cut = 1 - r["resident"] / base["resident"] if base["resident"] else 0.0
        peak = "-" if r["peak"] is None else f"{r['peak'] / MiB:.1f}"
        slow = r["step_s"] / base["step_s"] - 1
        print(f"{r['name']:<16}{r['resident'] / MiB:>13.2f}{change(-cut):>9}"
              f"{r['copied'] / MiB:>12.2f}{peak:>10}{r['step_s'] * 1e3:>9.1f}{change(slow):>9}  "
              f"{verdict}")
    off = results[1]
    floor = 2 * off["copied"] / bandwidth
    link = "pinned device-to-host copy" if device.type == "cuda" else "memcpy (no host link on a CPU)"
    print(f"bound: memory, 100% of the saved activation bytes off the device; time, offload's "
          f"{off['copied'] / MiB:.1f} MiB out and back at {bandwidth / 1e9:.1f} GB/s ({link}, "
          f"measured) take {floor * 1e3:.1f} ms per step unoverlapped; fully overlapped the "
          f"step is the baseline's {base['step_s'] * 1e3:.1f} ms")
    print("step time spread (min..max over rounds): " + ", ".join(
        f"{r['name']} {r['spread'][0] * 1e3:.1f}..{r['spread'][1] * 1e3:.1f} ms" for r in results))
    if device.type == "cuda":
        off = results[1]
        cut = 1 - off["peak"] / base["peak"]
        slow = off["step_s"] / base["step_s"] - 1
        print(f"vDNN goal: >= 80% less activation memory ({change(cut, signed=False)}) with "
              f"<= 20% slowdown ({change(slow)}): "
              f"{'PASS' if cut >= 0.8 and slow <= 0.2 else 'FAIL'}")


if __name__ == "__main__":
    _cli.run(main)
