"""Byte sizes: read them from config ('2GiB') and print them for humans, and what a job too
large for its memory should change (:func:`how_to_fit`)."""

from __future__ import annotations

import re

from accelopt.errors import ConfigError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(text: str, key: str = "size") -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1024' -> 1024."""
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"{key}: cannot read {text!r} as a size; write e.g. 2GiB or 512MB")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    binary = "i" in unit
    prefix = unit[:1] if unit[:1] in "kmgt" else ""
    scale = 1024 ** "kmgt".index(prefix) * 1024 if (binary and prefix) else _UNITS[prefix]
    return int(number * scale)


def format_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'; binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def how_to_fit(persistent_bytes: int, ephemeral_bytes: int, capacity_setting: str) -> str:
    """The change that makes a job too large for the memory fit, for the end of its
    rejection: it names what most of its need is. Mostly persistent (weights, gradients,
    optimizer state), a smaller batch barely helps and a model factory may ignore
    ``width``: its model's size has to shrink. Mostly ephemeral (one iteration's
    activations), the batch does."""
    if persistent_bytes >= ephemeral_bytes:
        return (f"most of it is persistent ({format_bytes(persistent_bytes)}: its model's "
                "parameters, gradients and optimizer state): make its model smaller (its "
                f"width, or the size its model_kwargs give) or raise {capacity_setting}")
    return (f"most of it is one iteration's ephemeral memory ({format_bytes(ephemeral_bytes)}): "
            f"lower its batch_size or raise {capacity_setting}")
