"""A job: model + data + optimizer + loss (or an inference loop), one iteration at a time.

A job knows nothing about scheduling: the executor decides when ``step()`` runs. Its data
is indexed by iteration (``dataset.batch(i)``), so a job's whole state is its model, its
optimizer and one integer, which is what makes bitwise-exact resume possible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from accelopt.config import JobConfig
from accelopt.errors import ConfigError
from accelopt.types import JobInfo, JobProfile, LayerOffer

if TYPE_CHECKING:
    from accelopt.host import PluginHost
from accelopt.workloads import (
    build_dataset,
    build_model,
    check_compatible,
    default_dataset_for,
)

LayerHook = Callable[[LayerOffer], nn.Module]
"""Given a layer offer, return the module to use (the offered one or a replacement)."""

OPTIMIZERS = ("sgd", "adam")
KINDS = ("train", "infer")


class Job:
    """One training or inference job, stepped by the executor."""

    def __init__(
        self,
        spec: JobConfig,
        *,
        job_id: str,
        device: torch.device,
        layer_hook: LayerHook | None = None,
    ) -> None:
        _validate(spec)
        self.spec = spec
        self.device = device
        try:
            dataset_name = spec.dataset or default_dataset_for(spec.model)
            self.dataset = build_dataset(dataset_name, seed=spec.seed)
            check_compatible(spec.model, self.dataset)
        except ValueError as exc:
            raise ConfigError(f"job '{spec.name}': {exc}") from None
        self.info = JobInfo(
            job_id=job_id,
            name=spec.name,
            model=spec.model,
            kind=spec.kind,  # type: ignore[arg-type]
            arrival_s=float(spec.arrival_s),
            iterations=int(spec.iterations),
            batch_size=int(spec.batch_size),
        )
        # Weights come from the job's own seed, not from whatever the global RNG holds, so
        # a job built next to others starts from the same weights as when built alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            try:
                model = build_model(
                    spec.model,
                    input_shape=tuple(self.dataset.input_shape),
                    num_classes=self.dataset.num_classes,
                    vocab_size=self.dataset.vocab_size,
                    width=spec.width,
                )
            except ValueError as exc:
                raise ConfigError(f"job '{spec.name}': {exc}") from None
            if layer_hook is not None:
                model = offer_layers(model, self.info, layer_hook)
        self.model = model.to(device)
        self.loss_fn = job_loss(self.dataset)
        self.optimizer = make_optimizer(spec, self.model) if spec.kind == "train" else None
        self.iteration = 0
        if spec.kind == "infer":
            self.model.eval()

    # -- stepping ------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.iteration >= self.info.iterations

    def step(self) -> tuple[float | None, int]:
        """Run the next iteration; return (loss, samples)."""
        x, y = self.dataset.batch(self.iteration, self.info.batch_size)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.optimizer is None:
            with torch.inference_mode():
                out = self.model(x)
            self.iteration += 1
            return None, int(y.shape[0])
        out = self.model(x)
        loss = self.loss_fn(out, y)
        # set_to_none=False keeps gradient buffers alive between iterations: they are part
        # of the job's persistent memory, as the profile counts them.
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()
        self.iteration += 1
        return float(loss.detach()), int(y.shape[0])

    def with_profile(self, profile: JobProfile) -> None:
        self.info = dataclasses.replace(self.info, profile=profile)

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "model": self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = int(state["iteration"])


def job_loss(dataset: Any) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The training loss: the dataset's own ``loss_fn(out, y)`` when it has one (multi-label
    targets need one), else cross-entropy over class indices. A model output that has a
    ``loss_against(y)`` method computes its own loss (a sampled output layer only knows which
    logits it computed once it sees the targets)."""
    base = getattr(dataset, "loss_fn", None) or nn.CrossEntropyLoss()

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        own = getattr(out, "loss_against", None)
        return own(y) if callable(own) else base(out, y)

    return loss


def _validate(spec: JobConfig) -> None:
    where = f"job '{spec.name}'"
    if spec.kind not in KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    if spec.optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"{where}: optimizer must be one of {', '.join(OPTIMIZERS)}, got {spec.optimizer!r}"
        )
    if spec.iterations < 1:
        raise ConfigError(f"{where}: iterations must be >= 1, got {spec.iterations}")
    if spec.batch_size < 1:
        raise ConfigError(f"{where}: batch_size must be >= 1, got {spec.batch_size}")
    if spec.lr <= 0:
        raise ConfigError(f"{where}: lr must be > 0, got {spec.lr}")


def make_optimizer(spec: JobConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum)


def layer_build_hook(*hosts: PluginHost) -> LayerHook | None:
    """The layer hook a job is built with: every layer offered to ``accelopt_layer_build``
    of each host in turn (a multi-job cluster rank has a per-job and a run-level host), or
    None when no plugin implements it. One function so a single-process run and every
    cluster rank transform a model identically (a parameter server and its workers must
    agree on the parameters' shapes)."""
    building = [h for h in hosts if h.implements("accelopt_layer_build")]
    if not building:
        return None

    def layer_hook(offer: LayerOffer) -> Any:
        module = offer.module
        for host in building:
            module = host.chain("accelopt_layer_build", module,
                                lambda m: {"layer": dataclasses.replace(offer, module=m)})
        return module

    return layer_hook


def offer_layers(model: nn.Module, job: JobInfo, layer_hook: LayerHook) -> nn.Module:
    """Offer every submodule (pre-order) once; install whatever the hook returns.

    A replaced module's children are not offered again: the replacement is the plugin's.
    The root itself is offered last under path ``""`` so a plugin may wrap the whole model.
    """
    index = 0

    def visit(parent: nn.Module, prefix: str) -> None:
        nonlocal index
        for name, child in list(parent.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            offer = _offer(job, path, index, child)
            index += 1
            replacement = layer_hook(offer)
            if replacement is not child:
                setattr(parent, name, replacement)
                continue
            visit(child, path)

    visit(model, "")
    return layer_hook(_offer(job, "", index, model))


def _offer(job: JobInfo, path: str, index: int, module: nn.Module) -> LayerOffer:
    return LayerOffer(
        job=job,
        path=path,
        index=index,
        module=module,
        module_type=type(module).__name__,
        in_features=getattr(module, "in_features", None),
        out_features=getattr(module, "out_features", None),
    )
