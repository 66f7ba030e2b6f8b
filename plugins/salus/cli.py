"""CLI commands contributed by salus (filled in by the service module)."""

from __future__ import annotations

from accelopt import CliCommand


def commands() -> list[CliCommand]:
    return []
