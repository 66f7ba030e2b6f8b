"""Hydra launcher ``hydra/launcher=salus``: a sweep's runs share one device (salus)."""
