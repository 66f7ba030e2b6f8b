"""Shared pieces of the SLIDE benchmarks: the three trainers compared side by side.

* ``dense``: PyTorch EmbeddingBag(sparse=True) first layer + SparseAdam, ReLU, full
  Linear(128 -> L) with Adam, full softmax with 1/|y| targets (the fair dense baseline).
* ``sampled``: the same first layer; output rows held in a sparse Embedding; per batch the
  candidates are the batch's labels plus uniform negatives so that each sample scores as many
  neurons as SLIDE's average active set; softmax over the candidates; SparseAdam. With
  ``logq`` the negatives' logits get log(labels each stands for), the standard correction.
* ``slide``: the plugin's layers (SlideSparseInput + SlideLinear), the same network.

All three read the same preloaded padded batches and use the same thread count, in one
process with one memory setting (:data:`HUGE_PAGES_ENV`).
"""

from __future__ import annotations

import os
import platform
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from accelopt_plugins.slide.config import SlideConfig, as_config, validate
from accelopt_plugins.slide.layer import SlideLinear, SlideSparseInput
from accelopt_plugins.slide.xcmodel import XCNet, xc_softmax_loss
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from accelopt.errors import ConfigError, UserError

HIDDEN = 128
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for transparent huge pages on its CPU allocations of 2 MB and more (read
at each allocation; :func:`use_huge_pages`). Why on by default in every SLIDE benchmark: the dense baseline
allocates its 100 MB logits and gradients afresh every step, and with 4 KB pages the page
faults cost it a third of its step (500 -> 340 ms at 200K labels, measured with ``slide_step.py``). A baseline slowed down by page faults is not a fair one. Every method runs in
the same process, so all get the same setting; ``THP_MEM_ALLOC_ENABLE=0`` in the
environment turns it off for a comparison."""


def use_huge_pages() -> None:
    """Turn :data:`HUGE_PAGES_ENV` on unless the environment already sets it: called first by
    every benchmark's main (not at import, so importing this module changes nothing)."""
    os.environ.setdefault(HUGE_PAGES_ENV, "1")


def set_threads(n: int) -> None:
    torch.set_num_threads(n)
    numba.set_num_threads(n)


def huge_pages_on() -> bool:
    return os.environ.get(HUGE_PAGES_ENV, "0") not in ("", "0")


def machine() -> str:
    thp = "on" if huge_pages_on() else "off"
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"{numba.get_num_threads()} numba threads, torch {torch.__version__}, "
            f"numba {numba.__version__}, huge pages for torch tensors >= 2 MB {thp} "
            f"({HUGE_PAGES_ENV})")


def dense_adam(params: list[nn.Parameter], lr: float) -> torch.optim.Adam:
    """torch's Adam for a method's dense parameters, fused: one pass over each tensor instead
    of torch's default per-operation loop, which cost the dense baseline 84 of its 340 ms per
    step at 200K labels (27 ms fused, measured with ``slide_step.py``)."""
    return torch.optim.Adam(params, lr=lr, fused=True)


def preload(ds, first: int, count: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [ds.batch(i, batch) for i in range(first, first + count)]


def _ids_vals(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = x[:, 0, :].to(torch.int64)
    return ids.clamp(min=0), x[:, 1, :] * (ids >= 0)


class DenseNet(nn.Module):
    def __init__(self, n_features: int, init: XCNet, with_output: bool = True) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(n_features, HIDDEN, mode="sum", sparse=True)
        with torch.no_grad():
            self.embed.weight.copy_(init.embed.weight)
        self.bias = nn.Parameter(init.embed.bias.detach().clone())
        if with_output:
            self.out = nn.Linear(HIDDEN, init.out.out_features)
            self.out.load_state_dict(init.out.state_dict())

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        ids, vals = _ids_vals(x)
        return F.relu(self.embed(ids, per_sample_weights=vals) + self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(x))


class Trainer:
    """step(x, y) -> loss; ``times`` accumulates seconds per phase."""

    name = "?"

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.steps = 0

    def tick(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + now - start
        return now

    def reset(self) -> None:
        self.times, self.steps = {}, 0

    def backward_and_update(self, loss: torch.Tensor, t: float) -> float:
        """The timed tail every trainer with a dense and a sparse optimizer shares."""
        t = self.tick("forward", t)
        self.opt.zero_grad()
        self.sparse_opt.zero_grad()
        loss.backward()
        t = self.tick("backward", t)
        self.opt.step()
        self.sparse_opt.step()
        self.tick("optimizer", t)
        self.steps += 1
        return float(loss.detach())


class DenseTrainer(Trainer):
    name = "dense"

    def __init__(self, n_features: int, n_labels: int, lr: float, init: XCNet) -> None:
        super().__init__()
        self.model = DenseNet(n_features, init)
        self.sparse_opt = torch.optim.SparseAdam(list(self.model.embed.parameters()), lr=lr)
        self.opt = dense_adam([self.model.bias, *self.model.out.parameters()], lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t = time.perf_counter()
        loss = xc_softmax_loss(self.model(x), y)
        return self.backward_and_update(loss, t)

    def eval_model(self) -> nn.Module:
        return self.model


class SampledTrainer(Trainer):
    """Sampled softmax: labels of the batch + uniform negatives, shared by the batch."""

    name = "sampled"

    def __init__(self, n_features: int, n_labels: int, lr: float, init: XCNet,
                 per_sample: int, seed: int = 0, logq: bool = False) -> None:
        super().__init__()
        self.logq = logq
        self.first = DenseNet(n_features, init, with_output=False)
        self.w = nn.Embedding(n_labels, HIDDEN, sparse=True)
        self.b = nn.Embedding(n_labels, 1, sparse=True)
        with torch.no_grad():
            self.w.weight.copy_(init.out.weight)
            self.b.weight.copy_(init.out.bias[:, None])
        self.n_labels, self.per_sample = n_labels, per_sample
        self.gen = torch.Generator().manual_seed(seed)
        self.sparse_opt = torch.optim.SparseAdam(
            [*self.first.embed.parameters(), self.w.weight, self.b.weight], lr=lr)
        self.opt = dense_adam([self.first.bias], lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t = time.perf_counter()
        labels = y[y >= 0].unique()
        extra = max(0, self.per_sample - len(labels))
        neg = torch.randint(self.n_labels, (extra,), generator=self.gen)
        cand = torch.cat([labels, neg])
        pos = torch.searchsorted(labels, y.clamp(min=0))  # label -> its candidate column
        pos = torch.where(y >= 0, pos, torch.full_like(pos, -1))
        t = self.tick("hash", t)  # candidate sampling plays the role of SLIDE's hashing
        h = self.first.hidden(x)
        logits = h @ self.w(cand).T + self.b(cand)[:, 0]
        if self.logq and extra:  # each negative stands for (n - labels) / extra neurons
            shift = torch.zeros(len(cand))
            shift[len(labels):] = float(np.log((self.n_labels - len(labels)) / extra))
            logits = logits + shift
        loss = xc_softmax_loss(logits, pos)
        return self.backward_and_update(loss, t)

    def eval_model(self) -> nn.Module:
        first, w, b = self.first, self.w, self.b

        class Full(nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return first.hidden(x) @ w.weight.T + b.weight[:, 0]

        return Full()


class SlideTrainer(Trainer):
    name = "slide"

    def __init__(self, n_features: int, n_labels: int, lr: float, init: XCNet,
                 cfg: SlideConfig) -> None:
        super().__init__()
        import copy

        self.model = copy.deepcopy(init)
        lr = cfg.lr or lr  # the variant's own sparse-Adam lr, as the plugin reads it
        self.model.out = SlideLinear.from_linear(init.out, cfg, lr=lr)
        self.model.embed = SlideSparseInput(init.embed.weight, init.embed.bias, cfg, lr=lr)
        self.opt = dense_adam(list(self.model.parameters()), lr)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t = time.perf_counter()
        loss = self.model(x).loss_against(y)
        t = self.tick("fwd_total", t)
        self.opt.zero_grad()
        loss.backward()
        t = self.tick("bwd_total", t)
        self.opt.step()
        self.tick("opt_total", t)
        self.steps += 1
        return float(loss.detach())

    def reset(self) -> None:
        super().reset()
        self.model.out.reset_stats()
        emb = self.model.embed
        emb.t_forward = emb.t_backward = emb.t_optimizer = 0.0

    def phases(self) -> dict[str, float]:
        """Seconds per phase: hash (+ table lookups), forward, backward, optimizer, rebuild;
        the sparse first layer's time is added to forward/backward/optimizer."""
        s, emb = self.model.out.stats, self.model.embed
        out = {
            "hash": s["t_hash"],
            "forward": s["t_forward"] + emb.t_forward,
            "backward": s["t_backward"] + emb.t_backward,
            "optimizer": s["t_optimizer"] + emb.t_optimizer,
            "rebuild": s["t_rebuild"],
        }
        total = sum(self.times.values())
        out["other"] = max(0.0, total - sum(out.values()))
        return out

    def eval_model(self) -> nn.Module:
        return self.model


def init_net(n_features: int, n_labels: int, seed: int = 0) -> XCNet:
    torch.manual_seed(seed)
    return XCNet(n_features, n_labels, HIDDEN)


def slide_config(n_labels: int, **kw) -> SlideConfig:
    """The benchmarks' SLIDE settings (``n_labels`` wide, SimHash K=9 L=50, buckets of 128
    with reservoir insertion, top 1000 by hits, at least 1000 active, log-Q corrected random
    top-up, rebuild every 50, sparse Adam with global bias correction), with a variant's
    overrides checked the way ``plugins.slide.<key>=<value>`` is: an unknown key, a value of
    the wrong type or out of range is a one-line :class:`UserError` before any work."""
    base = SlideConfig(hash="simhash", k=9, l=50, bucket_size=128, insertion="reservoir",
                       sampling="topk", topk=1000, min_active=1000, rebuild="fixed",
                       rebuild_period=50)
    try:
        cfg = as_config(OmegaConf.merge(OmegaConf.structured(base), kw))
        validate(cfg)
    except OmegaConfBaseException as exc:
        first = str(exc).splitlines()[0]
        key = getattr(exc, "full_key", None)
        raise UserError(f"slide variant setting{f' {key}' if key else ''}: {first} (the keys "
                        "and types are SlideConfig's, plugins/slide/config.py)") from None
    except ConfigError as exc:
        raise UserError(f"slide variant setting: {exc}") from None
    return cfg


def parse_overrides(items: list[str]) -> dict:
    """SlideConfig overrides from the command line: ``["logq=true", "topk=2000"]`` ->
    {"logq": True, "topk": 2000}."""
    out: dict = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep:
            raise UserError(f"variant setting {item!r}: expected key=value (e.g. logq=true)")
        low = val.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
            continue
        for conv in (int, float):
            try:
                out[key] = conv(val)
                break
            except ValueError:
                continue
        else:
            out[key] = val
    return out


def parse_variant(spec: str) -> tuple[str, dict]:
    """``"name:key=value,key=value"`` -> (name, overrides); what the method name starts with
    picks the trainer (``dense``, ``sampled``, anything else is SLIDE)."""
    name, _, rest = spec.partition(":")
    kw = parse_overrides(list(filter(None, rest.split(","))))
    kind = _kind(name)
    if kind and set(kw) - _ALLOWED[kind]:
        raise UserError(f"variant {name!r}: {kind} takes no setting "
                        f"{sorted(set(kw) - _ALLOWED[kind])} (only {sorted(_ALLOWED[kind])})")
    if kind is None:
        slide_config(0, **kw)  # checked now, before any data is read
    return name, kw


_ALLOWED = {"dense": {"lr"}, "sampled": {"logq", "lr"}}
"""The settings a baseline variant takes (SLIDE variants take any SlideConfig key)."""


def _kind(name: str) -> str | None:
    return ("dense" if name.startswith("dense") else
            "sampled" if name.startswith("sampled") else None)


def make_trainer(name: str, kw: dict, n_features: int, n_labels: int, lr: float, init: XCNet,
                 sampled_active: int) -> Trainer:
    """The trainer a variant names, with its overrides: ``lr`` (every method: its own
    learning rate instead of the run's), ``logq`` (``sampled``); SLIDE takes any
    SlideConfig key. A variant's name picks the trainer: ``dense*``, ``sampled*``, else SLIDE."""
    kind = _kind(name)
    if kind:
        lr = float(kw.get("lr", lr))
    if kind == "dense":
        return DenseTrainer(n_features, n_labels, lr, init)
    if kind == "sampled":
        return SampledTrainer(n_features, n_labels, lr, init, per_sample=sampled_active,
                              logq=bool(kw.get("logq", False)))
    return SlideTrainer(n_features, n_labels, lr, init, slide_config(n_labels, **kw))


def p_at_k(model: nn.Module, ds, limit: int = 2000) -> tuple[float, float]:
    from accelopt_plugins.slide.metrics import precision_at_k

    p1, p5 = precision_at_k(model, ds, (1, 5), limit=limit)
    return p1, p5


def median(values: list[float]) -> float:
    return float(np.median(values))
