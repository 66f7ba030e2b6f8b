"""The run configuration's schema, as structured configs registered with Hydra.

Typing the schema means a wrong type or an unknown key fails at composition time with the
key's name (``run.seed=abc`` -> "run.seed: Value 'abc' of type 'str' could not be converted
to Integer"), before any job is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf, ValidationError
from omegaconf.nodes import BooleanNode

from accelopt.errors import PluginResolutionError, first_line, listed

YOUR_LOOP_DATASET = "your loop"
"""The dataset of a job that ``accelopt.attach`` describes: the user's loop feeds it, and
steps its optimizer (a plugin updating parameters itself gets no rate schedule from it)."""


@dataclass
class JobConfig:
    """One job of a workload. ``dataset: null`` picks the model's default synthetic data."""

    name: str = "job"
    model: str = "mlp"
    dataset: Optional[str] = None
    kind: str = "train"
    batch_size: int = 32
    iterations: int = 50
    arrival_s: float = 0.0
    optimizer: str = "sgd"
    """``sgd``, ``adam`` or ``adamw``."""
    lr: float = 0.05
    momentum: float = 0.9
    """SGD's momentum, in [0, 1) (the other optimizers ignore it; a warning names one set for
    them)."""
    weight_decay: Optional[float] = None
    """L2 penalty (``sgd``, ``adam``) or decoupled decay (``adamw``); None: the optimizer's
    own default (0, 0, 0.01)."""
    lr_schedule: str = "constant"
    """``constant``, ``cosine`` (to ``min_lr`` at the last iteration) or ``linear``; both
    after ``warmup_iterations`` of linear warm-up from ``lr / warmup_iterations``."""
    warmup_iterations: int = 0
    min_lr: float = 0.0
    grad_clip: Optional[float] = None
    """Clip the job's whole gradient to this L2 norm before each step (in a cluster run, the
    norm of the reduced gradient, over every parameter server's shard); None: no clipping."""
    precision: str = "fp32"
    """``fp32``; ``bf16``: forward and loss under bf16 autocast (CPU and CUDA); ``fp16``: fp16
    autocast with a gradient scaler (CUDA, one process)."""
    width: Optional[int] = None
    seed: int = 0
    evaluate: bool = True
    """Score the trained model on the dataset's held-out set when the job ends (top-1:
    accuracy, or P@1 for multi-label data), outside the job's timed work."""
    model_kwargs: Any = None
    """Keywords for a ``module:factory`` model, e.g. ``{num_classes: 10}``: passed with the
    standard ones (``input_shape``, ``num_classes``, ``vocab_size``, ``width``) that its
    signature names. A mapping; typed ``Any`` so ``...model_kwargs={...}`` composes."""
    dataset_kwargs: Any = None
    """Keywords for a ``module:factory`` dataset (with ``seed`` if it names it; a job has no
    ``n_train``: a factory that takes one gets it here)."""
    loss: str = "auto"
    """``auto``: the dataset's ``loss_fn`` if it has one, else cross-entropy over the
    model's logits; ``model``: the model computes it, called as ``model(x, labels=y)`` and
    its output's ``loss`` taken (HF transformers' convention)."""


@dataclass
class TraceGeneratorConfig:
    """A seeded Poisson trace appended to the workload's explicit jobs (``n_jobs: 0``: none)."""

    n_jobs: int = 0
    seed: int = 0
    mean_interarrival_s: float = 1.0
    models: list[str] = field(default_factory=lambda: ["mlp", "cnn"])
    batch_sizes: list[int] = field(default_factory=lambda: [16, 32])
    min_iterations: int = 10
    max_iterations: int = 200
    pareto_alpha: float = 1.5


@dataclass
class WorkloadConfig:
    name: str = "default"
    jobs: list[JobConfig] = field(default_factory=list)
    generate: TraceGeneratorConfig = field(default_factory=TraceGeneratorConfig)


@dataclass
class NetworkConfig:
    """A shaped network for cluster runs (``bandwidth: null`` and ``topology: shared``: the
    machine's own loopback, unshaped)."""

    bandwidth: Optional[str] = None
    latency: Optional[str] = None
    topology: str = "shared"
    """``shared``: every rank on one shaped loopback; ``hosts``: a namespace per rank joined
    by veth links to a switch, each link shaped on its own."""
    links: Any = None
    """Hosts topology: links with their own rate, ``{worker1: 25mbit}`` (or a rank number).
    Typed ``Any`` and None by default: a struct-mode empty mapping would refuse every key of
    ``cluster.network.links={...}`` (checked in ``drivers/cluster/settings.py``)."""


@dataclass
class ClusterConfig:
    """Data parallelism over torch.distributed processes (``mode: none``: one process)."""

    mode: str = "none"
    workers: int = 2
    servers: int = 1
    backend: str = "auto"
    bucket_mb: float = 1.0
    timeout_s: float = 30.0
    master_port: int = 0
    network: NetworkConfig = field(default_factory=NetworkConfig)


@dataclass
class RunSettings:
    seed: int = 0
    """Added to every job's own seed (weights, data order, dropout): ``run.seed=0,1,2``
    repeats the workload with other random numbers. A generated trace's arrivals and
    lengths keep ``workload.generate.seed``."""
    device: str = "auto"
    threads: int = 0
    """torch intra-op threads (0: leave torch's default)."""
    deterministic: bool = True
    memory_capacity: str = "auto"
    """Device memory the allocation hook is told about: 'auto' (the real device memory on
    CUDA, the machine's RAM on CPU) or a size such as '2GiB'."""
    checkpoint_every: int = 0
    resume: Optional[str] = None
    """A run directory to continue from its checkpoints, with its own config. The resumed
    run writes into its own new directory (metrics.json records ``resumed_from``); the
    original directory is only read."""
    resume_finished: bool = False
    """Resume even a run that finished (every job done): its jobs are carried over as they
    ended and the run is reported again in the new directory. Without it that is refused."""
    save_weights: bool = True
    profile: bool = True
    """Measure each job's memory (persistent, ephemeral, peak) on a copy of it before the
    clock starts, for the allocation hooks (salus's lanes) and the jobs table. One process:
    it takes part of ``duration_s``, reported beside it as ``profiling_s``, and none of the
    jobs' times; the telemetry samples start with the clock, as the spans do."""
    progress: bool = True
    telemetry_interval_s: float = 0.5
    """Seconds between telemetry samples; at least 0.05 (a process's CPU time is counted in
    ~10 ms ticks: shorter intervals read 0% or thousands of percent)."""
    trace_hooks: bool = True
    """Time every hook call onto the ``hooks`` track of ``trace.json`` (each rank's own in a
    cluster run): a slow hook is visible. ``false`` saves the timing (two clock reads and
    three appends a call)."""
    hook_watchdog_s: float = 60.0
    """Say in one line (a warning naming the plugin, the hook and the thread) when a plugin's
    hook call has run this many seconds while jobs train: a blocking hook stalls its work
    silently otherwise. Nothing is stopped. 0 turns it off."""
    repeat: int = 0
    """A label only (no effect): lets a Hydra multirun sweep repeat identical runs."""
    compare: str = "none"
    """none | baseline | each: with plugins selected, also run the same workload without
    plugins (baseline), and each selected plugin alone (each), in this invocation, and print
    them side by side. Ignored in a multirun sweep (a sweep is its own comparison); refused under
    ``hydra/launcher=salus``."""


@dataclass
class AccelConfig:
    run: RunSettings = field(default_factory=RunSettings)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    plugins: dict[str, Any] = field(default_factory=dict)


BOOLEAN_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True,
                 "off": False, "y": True, "n": False}
"""The words OmegaConf takes for a boolean (any case); of numbers only 1 and 0 are taken."""


def strict_boolean(value: Any) -> bool:
    """A boolean setting's value as OmegaConf converts it, but refusing every number other
    than 1 and 0: OmegaConf turns any integer into ``value != 0``, so ``run.deterministic=2``
    or ``plugins.tictac.force=-3`` ran as ``true`` without a word (a typo, or a count given
    to a switch). Raises omegaconf's ``ValidationError``: the composing error names the key."""
    if isinstance(value, bool):
        return value
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, int) or (isinstance(text, str) and text.lstrip("+-").isdigit()):
        if int(text) in (0, 1):
            return int(text) == 1
    elif isinstance(value, str) and value.lower() in BOOLEAN_WORDS:
        return BOOLEAN_WORDS[value.lower()]
    raise ValidationError("'$VALUE' is not a boolean; give true or false")


@contextlib.contextmanager
def strict_booleans() -> Iterator[None]:
    """Within: every boolean node of a config, the schema's and each plugin's alike, converts
    its values with :func:`strict_boolean` (the one place both are typed: OmegaConf's
    ``BooleanNode``). Composing the run's config up front within it refuses the value before
    anything starts; the original conversion is back on leaving."""
    original = BooleanNode.__dict__["_validate_and_convert_impl"]
    BooleanNode._validate_and_convert_impl = (  # type: ignore[method-assign]
        lambda self, value: strict_boolean(value))
    try:
        yield
    finally:
        BooleanNode._validate_and_convert_impl = original  # type: ignore[method-assign]


def register_schema(overrides: Sequence[str] = ()) -> None:
    """Register the base schema (``base_config``) that ``configs/config.yaml`` extends, and,
    when ``overrides`` pick an ``experiment=`` preset, the config of each installed plugin a
    preset selects (:func:`preset_plugins`) not registered yet: Hydra composes
    ``experiment=NAME`` only if the ``plugins/<name>`` nodes its defaults list names exist,
    and the command line, whose ``+plugins=[...]`` registers the others, does not name them.
    One a preset names that is not installed stays unregistered: Hydra's "no plugins 'x'"
    line then says so."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=AccelConfig)
    if not any(o.lstrip("+").startswith("experiment=") for o in overrides):
        return  # no preset: nothing of theirs to find (and no plugin imported for it)
    registered = cs.repo.get("plugins", {})
    missing = [n for n in preset_plugins() if f"{n}.yaml" not in registered]
    if missing:
        from accelopt.plugin import Registry

        registry = Registry.discover()
        installed = set(registry.names())
        register_plugin_configs([registry.get(n) for n in missing if n in installed])


def preset_plugins() -> list[str]:
    """The plugins the experiment presets (``configs/experiment/*.yaml``) select in their
    defaults lists (``- /plugins: [salus, tictac]``), in file order, each once."""
    from pathlib import Path

    import accelopt.configs

    names: list[str] = []
    for path in sorted((Path(accelopt.configs.__file__).parent / "experiment").glob("*.yaml")):
        for entry in OmegaConf.load(path).get("defaults") or []:
            chosen = entry.get("/plugins", entry.get("plugins")) if isinstance(entry, DictConfig) \
                else None
            chosen = [chosen] if isinstance(chosen, str) else list(chosen or [])
            names += [str(n) for n in chosen if str(n) not in names]
    return names


def register_plugin_configs(specs: list[Any]) -> None:
    """Register each plugin's config dataclass as ``plugins/<name>`` at ``plugins.<name>``,
    so ``+plugins=[a,b]`` selects them and ``plugins.a.key=value`` is type-checked."""
    cs = ConfigStore.instance()
    for spec in specs:
        untyped = untyped_fields(spec.config)
        if untyped:  # OmegaConf takes Any, and then checks nothing a user gives it
            raise PluginResolutionError(invalid_schema(spec.name, spec.config, TypeError(
                f"field '{untyped[0]}' is Any: a value of any type would pass unchecked")))
        try:
            cs.store(group="plugins", name=spec.name, node=spec.config,
                     package=f"plugins.{spec.name}")
        except Exception as exc:  # omegaconf's ValidationError: a field type it cannot hold
            raise PluginResolutionError(invalid_schema(spec.name, spec.config, exc)) from None


def untyped_fields(config_type: Any, prefix: str = "") -> list[str]:
    """The fields of a config dataclass (nested ones too) typed ``Any`` or
    ``Optional[Any]``: what OmegaConf accepts without checking the values given."""
    if not (isinstance(config_type, type) and dataclasses.is_dataclass(config_type)):
        return []
    try:
        hints = typing.get_type_hints(config_type)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: OmegaConf says
        return []
    out: list[str] = []
    for f in dataclasses.fields(config_type):
        hint = hints.get(f.name)
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if hint is Any or (typing.get_origin(hint) is typing.Union and args == [Any]):
            out.append(f"{prefix}{f.name}")
        else:
            out += untyped_fields(hint, f"{prefix}{f.name}.")
    return out


def invalid_schema(name: str, config_type: type, exc: BaseException) -> str:
    """The one line saying a plugin's config dataclass is no OmegaConf schema, and which
    field types are (the conformance suite says the same)."""
    first = first_line(exc) or type(exc).__name__
    return (f"plugin '{name}': {config_type.__name__} is not a valid OmegaConf schema "
            f"({first}); use int, float, str, bool, Enum, Optional[...], list[...], "
            "dict[str, ...] or nested dataclasses for its fields")


def unknown_keys(cfg: DictConfig, stray_plugins: Collection[str] = ()) -> list[str]:
    """The dotted keys of a composed configuration that its schema does not have.

    Why a walk after composing: Hydra's ``+key=value`` appends a key even to a typed node, so
    ``+plugin=[salus]`` (for ``+plugins``), ``+run.sed=3`` or ``+plugins.salus.polcy=srtf``
    compose without a word and the run goes on without them: a CI matrix whose technique
    entries quietly run the baseline. A ``plugins.NAME`` entry that is not the plugin's typed
    node (``+plugins.salus.policy=srtf`` without ``+plugins=[salus]``) is reported by its first
    key too, unless NAME is in ``stray_plugins`` (``accelopt bench`` force-adds per-plugin
    settings to every set and drops them from the sets that do not select the plugin)."""
    found: list[str] = []
    _walk(cfg, "", found)
    plugins = cfg.get("plugins") if isinstance(cfg, DictConfig) else None
    for name, node in (plugins.items() if isinstance(plugins, DictConfig) else []):
        typed = isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))
        if typed:
            _walk(node, f"plugins.{name}.", found)
        elif str(name) not in stray_plugins:
            keys = list(node.keys()) if isinstance(node, DictConfig) else []
            found.append(f"plugins.{name}.{keys[0]}" if keys else f"plugins.{name}")
    return found


def _walk(node: Any, prefix: str, found: list[str]) -> None:
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            _walk(item, f"{prefix}{i}.", found)
        return
    if not isinstance(node, DictConfig):
        return
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):  # a free-form mapping (model_kwargs, plugins)
        return
    known = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in known:
            found.append(f"{prefix}{key}")
        elif key != "plugins" or prefix:  # the plugins mapping: checked by unknown_keys
            _walk(node[key], f"{prefix}{key}.", found)


def differing_keys(a: Any, b: Any, shown: int = 3) -> str:
    """The dotted keys whose values differ between two configurations (nested dicts, lists
    of job dicts), the first ``shown`` of them: what one line says when two processes that
    must agree (the ranks of a run, the ranks of a DDP script) were given different ones."""
    flat_a, flat_b = _flat(a), _flat(b)
    keys = sorted(k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k) != flat_b.get(k))
    return listed(keys, shown)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        items = enumerate(value)
    else:
        return {prefix.rstrip("."): value}
    out: dict[str, Any] = {}
    for key, item in items:
        out.update(_flat(item, f"{prefix}{key}."))
    return out
