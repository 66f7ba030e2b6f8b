"""slide: LSH-sampled sparse training of very wide output layers on CPUs (SLIDE).

See ``plugins/slide/README.md`` for the method card.
"""

from __future__ import annotations

from accelopt_plugins.slide.config import SlideConfig
from accelopt_plugins.slide.plugin import SlidePlugin

from accelopt import PluginSpec

PLUGIN = PluginSpec(
    name="slide",
    factory=SlidePlugin,
    config=SlideConfig,
    description="Replaces a wide output Linear with an LSH-sampled sparse layer (SLIDE).",
)
