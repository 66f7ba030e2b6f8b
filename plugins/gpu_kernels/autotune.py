"""Per-layer convolution autotuning with an on-disk decision cache.

What cudnn.benchmark does inside cuDNN, done in the open: for each Conv2d, on the real input
shape (captured at its first forward, or given as a sample), every *valid* algorithm of
``conv_algos`` is timed and the fastest kept, with one rule that guards against noise:

**Noise rule.** Algorithms are timed in interleaved rounds (each round runs every algorithm
once, in a shuffled order, so drift and background load hit all of them alike); each sample
repeats the call enough times to last >= ~1 ms. An alternative replaces ``direct`` only if
(a) its median is at least ``min_gain`` (default 5%) below direct's median, *and* (b) its
75th percentile is below direct's 25th percentile (the middle halves do not overlap).
Otherwise the layer stays on ``direct``: a layer is never switched on a coin flip.

Decisions are cached per (device, dtype, mode, shapes, conv hyper-parameters) in a JSON
file written atomically (``accelopt.atomic.atomic_open``: a reader never sees half a file).
A cache that does not parse or has the wrong structure is reported with a warning and
rebuilt (``DecisionCache.problem`` says why, for the plugin's report row); an entry naming
an algorithm that is not valid for its layer is dropped. A cache that cannot be written
(any ``OSError``: a full disk, a read-only directory, a directory where the file should be)
never fails the layer being tuned: the decisions stay in memory and
``DecisionCache.unsaved`` says why they were not saved.
"""

from __future__ import annotations

import json
import math
import platform
import random
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelopt_plugins.gpu_kernels.conv_algos import (
    AlgoConv2d,
    conv_params,
    run_algorithm,
    valid_algorithms,
)
from torch import nn

from accelopt.atomic import atomic_open
from accelopt.job.job import logits_of

CACHE_VERSION = 1


class CacheCorruptedWarning(UserWarning):
    """The autotuning cache could not be read; it is rebuilt."""


def device_label(device: torch.device) -> str:
    """What the timings depend on: the device model (and CPU thread count) plus torch."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{_cpu_model()} x{torch.get_num_threads()}threads"
    return f"{device.type}:{name}|torch{torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(conv: nn.Conv2d, x: torch.Tensor, mode: str) -> str:
    p = conv_params(conv)
    return "|".join([
        device_label(x.device), str(x.dtype).replace("torch.", ""), mode,
        "x" + "x".join(map(str, x.shape)), "w" + "x".join(map(str, conv.weight.shape)),
        f"s{p['stride']}p{p['padding']}d{p['dilation']}g{p['groups']}",
        f"bias{conv.bias is not None}",
    ])


@dataclass
class Decision:
    algorithm: str
    median_ms: dict[str, float]
    from_cache: bool = False


@dataclass
class DecisionCache:
    """The JSON file of decisions; ``path=None`` keeps them in memory only."""

    path: Path | None
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    rebuilt: bool = False
    problem: str | None = None
    """Why the file was unreadable when loaded (it is rebuilt), for a report; ``None`` if
    it read fine or did not exist. A warning alone reached stderr only, never the run's
    outputs."""
    unsaved: str | None = None
    """Why the latest write of the file failed (``None`` once one succeeds): a cache is an
    optimisation, so a write refused by the machine must not fail the training job."""

    @classmethod
    def load(cls, path: str | Path | None) -> DecisionCache:
        if not path:
            return cls(None)
        path = Path(path).expanduser()
        cache = cls(path)
        cache.entries = cache._read()
        return cache

    def _read(self) -> dict[str, dict[str, Any]]:
        assert self.path is not None
        try:
            if not self.path.exists():
                return {}
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
                raise ValueError("not an accelopt gpu_kernels cache of version 1")
            entries = data["entries"]
            if not isinstance(entries, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("algorithm"), str)
                for v in entries.values()
            ):
                raise ValueError("malformed entries")
            return entries
        except (ValueError, KeyError, OSError, UnicodeDecodeError) as exc:
            why = _one_line(exc)
            self.problem = why
            warnings.warn(
                f"gpu_kernels: autotuning cache {self.path} is corrupted ({why}); "
                "ignoring it and rebuilding it from fresh measurements",
                CacheCorruptedWarning,
                stacklevel=3,
            )
            self.rebuilt = True
            return {}

    def get(self, key: str, valid: list[str]) -> str | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        if entry["algorithm"] not in valid:
            warnings.warn(
                f"gpu_kernels: cache entry names {entry['algorithm']!r}, not valid for this "
                "layer; re-measuring", CacheCorruptedWarning, stacklevel=3)
            del self.entries[key]
            return None
        return str(entry["algorithm"])

    def put(self, key: str, decision: Decision) -> None:
        self.entries[key] = {"algorithm": decision.algorithm, "median_ms": decision.median_ms}
        if self.path is None:
            return
        # merge with what other processes wrote meanwhile (unless the file is corrupted)
        merged: dict[str, dict[str, Any]] = {}
        if not self.rebuilt:
            problem = self.problem
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CacheCorruptedWarning)
                merged = self._read()
            self.problem = problem  # a re-read is a merge, not what the load found
        merged.update(self.entries)
        self.entries = merged
        try:
            with atomic_open(self.path) as fh:
                json.dump({"version": CACHE_VERSION, "entries": merged}, fh, indent=1,
                          sort_keys=True)
        except OSError as exc:  # the decisions stay in memory; the report says so
            self.unsaved = _one_line(exc)
            return
        self.unsaved = None
        self.rebuilt = False

    def notes(self) -> list[str]:
        """One short phrase per problem with the file, for a report row: read unreadable
        (rebuilt), or the decisions not saved."""
        out = []
        if self.problem is not None:
            out.append(f"conv cache {self.path} was unreadable ({self.problem}): rebuilt")
        if self.unsaved is not None:
            out.append(f"conv decisions not saved to {self.path} ({self.unsaved}); "
                       "they were used in this run only")
        return out


def _one_line(exc: BaseException) -> str:
    """``exc`` as a short single line: its OS reason for an ``OSError`` (the file is the
    cache's, named beside it; a write's own file is a hidden temp name), else its message
    with newlines folded, so a report row stays one line."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    elif isinstance(exc, json.JSONDecodeError):
        text = f"not valid JSON: {exc}"
    elif isinstance(exc, UnicodeDecodeError):
        text = "not UTF-8 text"
    elif isinstance(exc, KeyError):
        text = f"no {exc} key"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())[:200]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_callables(
    fns: dict[str, Callable[[], Any]], device: torch.device, reps: int, seed: int = 0
) -> dict[str, list[float]]:
    """Interleaved timing: ``reps`` rounds, each calling every fn once in shuffled order;
    every sample repeats its fn enough times to last ~1 ms. Seconds per call."""
    inner: dict[str, int] = {}
    for name, fn in fns.items():  # warm-up (allocations, FFT plans) and calibration
        fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        once = max(time.perf_counter() - t0, 1e-7)
        inner[name] = max(1, min(50, math.ceil(1e-3 / once)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner[name]):
                fns[name]()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / inner[name])
    return samples


def pick(samples: dict[str, list[float]], min_gain: float, baseline: str = "direct") -> str:
    """Apply the noise rule (module docstring): the fastest alternative, only if it is
    measurably faster than ``baseline``."""
    base = samples[baseline]
    med_base = statistics.median(base)
    q25_base = _quantile(base, 0.25)
    best = baseline
    for name, times in samples.items():
        if name == baseline:
            continue
        med = statistics.median(times)
        if (med <= (1.0 - min_gain) * med_base and _quantile(times, 0.75) < q25_base
                and (best == baseline or med < statistics.median(samples[best]))):
            best = name
    return best


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class ConvAutotuner:
    """Times the valid algorithms of a layer on a real input and remembers the choice."""

    def __init__(self, cache: DecisionCache | None = None, reps: int = 7,
                 min_gain: float = 0.05) -> None:
        self.cache = cache if cache is not None else DecisionCache(None)
        self.reps = reps
        self.min_gain = min_gain
        self.decisions: dict[str, Decision] = {}

    def choose(self, conv: nn.Conv2d, x: torch.Tensor, training: bool | None = None) -> Decision:
        """The algorithm for ``conv`` on inputs shaped like ``x``. ``training`` (default: the
        layer's mode with grad enabled) times forward+backward instead of forward only."""
        if training is None:
            training = conv.training and torch.is_grad_enabled()
        mode = "train" if training else "infer"
        valid = valid_algorithms(conv)
        key = cache_key(conv, x, mode)
        cached = self.cache.get(key, valid)
        if cached is not None:
            decision = Decision(cached, self.cache.entries[key].get("median_ms", {}), True)
        elif valid == ["direct"]:
            decision = Decision("direct", {})
        else:
            # the candidates' tensors are the tuner's, not the model's: pass-through
            # saved-tensor hooks (the innermost win) keep an outer plugin's (offload's) from
            # copying and counting them as the model's first iteration
            with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                samples = time_callables(
                    {a: _workload(a, conv, x, training) for a in valid}, x.device, self.reps
                )
            decision = Decision(
                pick(samples, self.min_gain),
                {a: round(statistics.median(t) * 1e3, 5) for a, t in samples.items()},
            )
            self.cache.put(key, decision)
        self.decisions[key] = decision
        return decision


def _as_is(t: torch.Tensor) -> torch.Tensor:
    """A saved-tensor hook that keeps the tensor as autograd would."""
    return t


def _workload(algorithm: str, conv: nn.Conv2d, x: torch.Tensor, training: bool) -> Callable[[], Any]:
    """One call of ``algorithm`` on detached copies of the layer's parameters (measuring
    never writes the real gradients)."""
    w = conv.weight.detach().clone().requires_grad_(training)
    b = None if conv.bias is None else conv.bias.detach().clone().requires_grad_(training)
    xin = x.detach().clone().requires_grad_(training and x.requires_grad)
    if not training:
        def infer() -> Any:
            with torch.no_grad():
                return run_algorithm(algorithm, conv, xin, w, b)
        return infer

    def train() -> Any:
        with torch.enable_grad():
            y = run_algorithm(algorithm, conv, xin, w, b)
            inputs = [t for t in (w, b, xin) if t is not None and t.requires_grad]
            return torch.autograd.grad(y, inputs, torch.ones_like(y))
    return train


class AutotunedConv2d(AlgoConv2d):
    """A Conv2d that picks its algorithm at its first forward (on the real input shape)
    and re-tunes if the input shape or mode changes (one decision per shape, cached)."""

    @classmethod
    def from_tuner(cls, conv: nn.Conv2d, tuner: ConvAutotuner) -> AutotunedConv2d:
        new = super().from_conv(conv, None)
        new._tuner = tuner  # type: ignore[attr-defined]
        new._chosen = {}  # type: ignore[attr-defined]
        new.decisions = {}  # (input shape, dtype, training) -> Decision
        return new  # type: ignore[return-value]

    override: str | None = None
    """Set by ``verify_model``: ``"direct"`` when the tuned choices did not make the whole
    model measurably faster."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.override is not None:
            return self._conv_forward(x, self.weight, self.bias)
        if x.dim() == 3:  # unbatched (C, H, W), as nn.Conv2d takes it: tuned as a batch of 1
            return self.forward(x.unsqueeze(0)).squeeze(0)
        key = (tuple(x.shape), x.dtype, self.training and torch.is_grad_enabled())
        algo = self._chosen.get(key)
        if algo is None:
            decision = self._tuner.choose(self, x)
            algo = decision.algorithm
            self._chosen[key] = algo
            self.decisions[key] = decision
        self.algorithm = algo
        if algo == "direct":
            return self._conv_forward(x, self.weight, self.bias)
        return run_algorithm(algo, self, x)


def autotune_model(model: nn.Module, tuner: ConvAutotuner) -> list[str]:
    """Replace every Conv2d of ``model`` (in place) by an AutotunedConv2d sharing its
    parameters; returns the replaced paths. Tuning happens at each layer's first forward."""
    replaced = []
    for path, module in list(model.named_modules()):
        if type(module) is nn.Conv2d or (isinstance(module, nn.Conv2d)
                                         and type(module) is AlgoConv2d):
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, name, AutotunedConv2d.from_tuner(module, tuner))
            replaced.append(path)
    return replaced


def model_step(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               training: bool) -> Callable[[], Any]:
    """One timed call of ``model`` as the job calls it (positional and keyword inputs: HF
    image models take ``pixel_values=``): in training a forward and a backward of its
    logits' sum (a ``ModelOutput``'s ``logits``), else a forward without autograd."""
    def run() -> Any:
        if training:
            model.zero_grad(set_to_none=True)
            out = logits_of(model(*args, **kwargs))
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"the model returned a {type(out).__name__} with no logits "
                                "tensor to time a backward of")
            out.float().sum().backward()
            return None
        with torch.no_grad():
            return model(*args, **kwargs)
    return run


def verify_model(model: nn.Module, x: torch.Tensor | tuple[Any, ...], *, training: bool,
                 reps: int = 7, min_gain: float = 0.05,
                 kwargs: dict[str, Any] | None = None) -> bool:
    """Whole-model guard on top of the per-layer rule: per-layer timings in isolation can
    mislead (caches, layout conversions between layers, a noisy machine), so a deep copy of
    ``model`` is timed with its tuned choices vs forced to direct, under the same noise
    rule. Unless the tuned model is measurably faster, every AutotunedConv2d of ``model`` is
    forced back to direct. ``x`` is the input tensor or the positional inputs, ``kwargs``
    the keyword inputs. Returns whether the tuned choices were kept."""
    import copy

    tuned = [m for m in model.modules() if isinstance(m, AutotunedConv2d)]
    if not any(a != "direct" for m in tuned for a in m._chosen.values()):  # type: ignore[attr-defined]
        return False
    clone = copy.deepcopy(model)
    convs = [m for m in clone.modules() if isinstance(m, AutotunedConv2d)]
    args = x if isinstance(x, tuple) else (x,)
    step = model_step(clone, args, kwargs or {}, training)
    found = [t for t in (*args, *(kwargs or {}).values()) if isinstance(t, torch.Tensor)]
    device = found[0].device if found else torch.device("cpu")

    def run(override: str | None) -> Callable[[], Any]:
        def timed() -> Any:
            for m in convs:
                m.override = override
            return step()
        return timed

    samples = time_callables({"direct": run("direct"), "tuned": run(None)}, device, reps)
    keep = pick(samples, min_gain) == "tuned"
    for m in tuned:
        m.override = None if keep else "direct"
    return keep
