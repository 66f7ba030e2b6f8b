"""gpu_kernels: node pruning vs weight pruning, convolution algorithm choice, tiled kernels,
data layout (REFERENCE.md section 4; method card in ``README.md`` beside this file).

The plugin works through ``accelopt_layer_build``: when offered the whole model (path ``""``)
it prunes neurons/channels physically, swaps Conv2d layers for autotuned ones, swaps Linear
layers for numba.cuda tiled kernels (CUDA only) and decides channels_last by measurement.
Every transform is also a library function usable on any model (see ``pruning``,
``weight_pruning``, ``conv_algos``, ``autotune``, ``tiled``, ``layout``).
"""

from __future__ import annotations

from accelopt_plugins.gpu_kernels.config import GpuKernelsConfig
from accelopt_plugins.gpu_kernels.plugin import GpuKernelsPlugin

from accelopt import PluginSpec

PLUGIN = PluginSpec(
    name="gpu_kernels",
    factory=GpuKernelsPlugin,
    config=GpuKernelsConfig,
    description=(
        "Node pruning (physical slicing), conv algorithm autotuning (direct/im2col/FFT/"
        "Winograd), numba.cuda tiled Linear, channels_last by measurement."
    ),
    # With slide, one meaning whatever the list order: slide takes the wide output Linear
    # first (tiled_linear would otherwise swap it for a TiledLinear SLIDE cannot take), and
    # pruning then sees SLIDE's layer, which it cannot slice, so the layer feeding it stays
    # dense (docs/combinations.md, slide + gpu_kernels).
    after=("slide",),
)

__all__ = ["PLUGIN", "GpuKernelsConfig", "GpuKernelsPlugin"]
