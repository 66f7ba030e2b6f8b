"""The layer-build hook point: every submodule of a freshly built model is offered once to
``accelopt_layer_build`` (chained), and what the plugins return is installed.

One function for every process, so a single-process run and every cluster rank transform a
model identically (a parameter server and its workers must agree on the parameters' shapes).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from accelopt.host import PluginHost
from accelopt.types import JobInfo, LayerOffer

HOOK = "accelopt_layer_build"


def offer_layers(model: nn.Module, job: JobInfo, host: PluginHost) -> nn.Module:
    """Offer every submodule (pre-order) once; install whatever the plugins return.

    A replaced module's children are not offered again: the replacement is the plugin's.
    The root itself is offered last under path ``""`` so a plugin may wrap the whole model.
    """
    if not host.implements(HOOK):
        return model
    index = 0

    def build(offer: LayerOffer) -> nn.Module:
        # an answer that is not a module is refused by the host, naming the plugin
        # (hookspecs.ANSWER_CHECKS)
        return host.chain(HOOK, offer.module,
                          lambda m: {"layer": dataclasses.replace(offer, module=m)})

    def visit(parent: nn.Module, prefix: str) -> None:
        nonlocal index
        for name, child in list(parent.named_children()):
            path = f"{prefix}.{name}" if prefix else name
            offer = _offer(job, path, index, child)
            index += 1
            replacement = build(offer)
            if replacement is not child:
                setattr(parent, name, replacement)
                continue
            visit(child, path)

    visit(model, "")
    return build(_offer(job, "", index, model))


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
