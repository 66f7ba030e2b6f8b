"""Configuration of the slide plugin (``plugins.slide.<key>=<value>``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SlideConfig:
    """Keys users set as ``plugins.slide.key=value``."""

    min_width: int = 4096
