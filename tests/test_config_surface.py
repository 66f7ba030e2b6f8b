"""The configuration surface a user types: experiment presets, value bounds, and the lines
that refuse a wrong key or value. Composition only (Hydra's compose API, as ``accelopt run``
does before anything starts); nothing trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from accelopt.cli.hydra_run import compose_checked, config_dir
from accelopt.config import register_schema

PRESETS = sorted(p.stem for p in (Path(config_dir()) / "experiment").glob("*.yaml"))


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """The dotted keys and values a preset file sets itself (its defaults list aside)."""
    if isinstance(node, DictConfig):
        out: dict[str, Any] = {}
        for key, value in node.items():
            if not prefix and key == "defaults":
                continue
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    if isinstance(node, ListConfig):
        return {prefix.rstrip("."): OmegaConf.to_container(node)}
    return {prefix.rstrip("."): node}


def _selected(preset: str) -> list[str]:
    defaults = OmegaConf.load(Path(config_dir()) / "experiment" / f"{preset}.yaml").defaults
    for entry in defaults or []:
        if isinstance(entry, DictConfig) and "/plugins" in entry:
            return list(entry["/plugins"])
    return []


@pytest.mark.parametrize("extra", [[], ["+plugins"]], ids=["alone", "with-plugins"])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_experiment_preset_composes_with_its_settings_and_plugins(preset, extra):
    selected = _selected(preset)
    if extra and not selected:
        pytest.skip("the preset selects no plugins")
    overrides = [f"experiment={preset}"]
    if extra:  # the documented form with the selection spelled out again
        overrides.append(f"+plugins=[{','.join(selected)}]")
    register_schema(overrides)
    cfg = compose_checked(overrides)
    assert list(cfg.plugins or {}) == selected
    own = _leaves(OmegaConf.load(Path(config_dir()) / "experiment" / f"{preset}.yaml"))
    for key, value in own.items():
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if isinstance(got, (DictConfig, ListConfig)) else got
        assert got == value, f"{preset}: {key} is {got!r}, the preset sets {value!r}"


def _refused(overrides: list[str]) -> str:
    """The one line a composed configuration's up-front checks refuse it with."""
    from accelopt.drivers.cluster.settings import settings_from
    from accelopt.errors import AccelOptError
    from accelopt.job.specs import job_specs

    register_schema()
    with pytest.raises(AccelOptError) as caught:
        cfg = compose_checked(["workload=tiny", *overrides])
        job_specs(cfg)
        if cfg.cluster.mode != "none":
            settings_from(cfg.cluster)
    return str(caught.value)


@pytest.mark.parametrize(("overrides", "needle"), [
    (["cluster.mode=ps", "cluster.workers=100000"], "cluster.workers + cluster.servers must be at most"),
    (["run.seed=99999999999999999999"], "run.seed must be in [-2**63, 2**64-1]"),
    (["workload.jobs.0.seed=18446744073709551616"], "job 'tiny-mlp': seed must be in"),
    (["run.seed=10", "workload.jobs.0.seed=18446744073709551610"], "seed + run.seed must be in"),
    (["workload.jobs.0.arrival_s=1e12"], "arrival_s must be in [0, 1e+09]"),
    (["workload.generate.n_jobs=2", "workload.generate.mean_interarrival_s=1e300"],
     "workload.generate.mean_interarrival_s must be in (0, 1e+09]"),
    (["workload.generate.n_jobs=-1"], "n_jobs must be >= 0 (0: no generated jobs)"),
])
def test_numbers_out_of_range_are_one_line_before_anything_starts(overrides, needle):
    line = _refused(overrides)
    assert needle in line and "\n" not in line


def test_a_zoo_model_too_wide_for_memory_is_one_line_naming_the_width():
    from accelopt.workloads import build_model

    with pytest.raises(ValueError, match=r"width=100000000000 cannot be built .*; lower width"):
        build_model("mlp", input_shape=(4,), num_classes=2, width=100_000_000_000)


@pytest.mark.parametrize("override", ["workload.jobs=[{name:a,lrr:1}]",
                                      "workload.jobs.0={name:a,lrr:1}"])
def test_an_unknown_key_in_a_whole_job_is_named_with_the_closest_field(override):
    from accelopt.errors import ConfigError

    register_schema()
    with pytest.raises(ConfigError, match=r"unknown config key 'lrr' in (a )?job.* did you mean "
                                          r"'lr'\?"):
        compose_checked(["workload=tiny", override])


def test_the_help_says_ps_mode_and_compare_come_with_the_default_workload():
    header = " ".join(OmegaConf.load(Path(config_dir()) / "config.yaml").hydra.help.header.split())
    assert "default workload (five jobs) brings its own cluster.mode=ps" in header
    assert "another workload=NAME runs on one process with no comparison" in header


def test_a_device_without_cuda_is_refused_as_typed():
    import torch

    from accelopt.drivers.setup import pick_device
    from accelopt.errors import AccelOptError

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    with pytest.raises(AccelOptError, match=r"run\.device=cuda:0 but no CUDA device"):
        pick_device("cuda:0")


def test_the_schema_docstring_quotes_the_real_message_for_a_wrong_type():
    import accelopt.config
    from accelopt.errors import ConfigError

    register_schema()
    with pytest.raises(ConfigError) as caught:
        compose_checked(["workload=tiny", "run.seed=abc"])
    assert str(caught.value) in " ".join((accelopt.config.__doc__ or "").split())


@pytest.mark.parametrize("override", ["run.deterministic=2", "run.deterministic=-1",
                                      "run.deterministic='2'", "run.deterministic=maybe",
                                      "run.deterministic=1.0", "+plugins=[tictac]",
                                      "+plugins=[gradcomm]"])
def test_a_boolean_setting_takes_true_or_false_not_any_number(override):
    """OmegaConf turns any integer into ``!= 0``: ``run.deterministic=2`` or ``-1``,
    ``plugins.tictac.force=-3``, ``plugins.gradcomm.overlap=2`` ran as true without a word,
    while 1.0 and 'maybe' were refused (without the fix). Core keys and plugins' alike."""
    from accelopt.errors import ConfigError
    from accelopt.plugin import Registry

    key, value = {"+plugins=[tictac]": ("plugins.tictac.force", "-3"),
                  "+plugins=[gradcomm]": ("plugins.gradcomm.overlap", "2")}.get(
        override, ("run.deterministic", override.split("=", 1)[1]))
    overrides = ["workload=tiny", override]
    if override.startswith("+plugins"):
        from accelopt.config import register_plugin_configs

        name = override.split("[")[1].rstrip("]")
        register_plugin_configs([Registry.discover().get(name)])
        overrides.append(f"{key}={value}")
    register_schema()
    with pytest.raises(ConfigError) as refused:
        compose_checked(overrides)
    assert str(refused.value) == f"{key}: '{value.strip(chr(39))}' is not a boolean; give " \
        "true or false"


def test_boolean_words_and_one_and_zero_are_still_taken_and_omegaconf_is_left_as_it_was():
    from omegaconf import ValidationError

    register_schema()
    for value, expected in [("1", True), ("0", False), ("yes", True), ("off", False),
                            ("True", True), ("false", False), ("'1'", True)]:
        cfg = compose_checked(["workload=tiny", f"run.deterministic={value}"])
        assert cfg.run.deterministic is expected, value
    # outside accelopt's composing, OmegaConf converts as it always did (nothing patched)
    from accelopt.config import RunSettings

    node = OmegaConf.structured(RunSettings)
    node.deterministic = 2
    assert node.deterministic is True
    with pytest.raises(ValidationError):
        node.deterministic = "maybe"
