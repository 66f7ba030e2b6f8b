"""Package layout that pyproject.toml alone cannot express.

The repository keeps the design card's top level (``accelopt/``, ``plugins/``, ``configs/``),
while the installed import names are ``accelopt``, ``accelopt_plugins`` (one subpackage per
plugin folder, found automatically) and ``accelopt.configs`` (so Hydra finds the configs in a
built wheel as well as in a checkout).
"""

from setuptools import find_packages, setup

core = find_packages(include=["accelopt", "accelopt.*"])
plugins = ["accelopt_plugins"] + [f"accelopt_plugins.{p}" for p in find_packages("plugins")]

setup(
    # hydra_plugins: a namespace package Hydra scans for launchers (hydra/launcher=salus)
    packages=core + plugins + ["accelopt.configs", "hydra_plugins.accelopt_salus_launcher"],
    package_dir={"accelopt_plugins": "plugins", "accelopt.configs": "configs"},
)
