"""offload: vDNN feature-map offloading (Rhu et al., MICRO 2016).

The feature maps a layer saves for backward leave device memory during forward (to pinned
host memory, on a side stream) and are prefetched back just ahead of the layer's backward.
See ``engine.py`` for the mechanism and ``README.md`` for the method card.
"""

from __future__ import annotations

from accelopt_plugins.offload.config import OffloadConfig

from accelopt import PluginSpec


def _factory(config: OffloadConfig) -> object:
    from accelopt_plugins.offload.plugin import OffloadPlugin

    return OffloadPlugin(config)


PLUGIN = PluginSpec(
    name="offload",
    factory=_factory,
    config=OffloadConfig,
    description="vDNN: offloads saved feature maps to host memory and prefetches them back.",
    # The engine hooks the model's leaf modules when the whole model is offered: it must see
    # the final model, after plugins that replace modules there (gpu_kernels swaps Conv2d /
    # Linear for autotuned / tiled ones), or its hooks would sit on modules no longer used.
    after=("gpu_kernels",),
)
