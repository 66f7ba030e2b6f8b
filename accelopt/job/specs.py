"""The jobs a run config describes: explicit ``workload.jobs`` then a generated trace, each
validated, each with its id. One function, used by the single-process run, by every rank of a
cluster run and by the up-front validation, so all of them see the same jobs."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accelopt.config import AccelConfig, JobConfig
from accelopt.errors import ConfigError, UserError
from accelopt.types import JobInfo
from accelopt.workloads import generate_trace

OPTIMIZERS = ("sgd", "adam", "adamw")
KINDS = ("train", "infer")
SCHEDULES = ("constant", "cosine", "linear")
PRECISIONS = ("fp32", "bf16", "fp16")
LOSSES = ("auto", "model")


def job_id_for(index: int, spec: JobConfig) -> str:
    """The id of the ``index``-th job of a workload (stable across processes and resumes)."""
    return f"{index:02d}-{spec.name}"


def job_info(spec: JobConfig, job_id: str) -> JobInfo:
    """The record of a job as its spec declares it (before the model exists: no parameter
    table or buckets yet)."""
    return JobInfo(job_id=job_id, name=spec.name, model=spec.model,
                   kind=spec.kind,  # type: ignore[arg-type]
                   arrival_s=float(spec.arrival_s), iterations=int(spec.iterations),
                   batch_size=int(spec.batch_size), optimizer=spec.optimizer,
                   lr=float(spec.lr), momentum=float(spec.momentum))


_BUILT: dict[str, list[JobConfig]] = {}
"""Workload (as canonical JSON) -> its validated specs: a run asks for them several times
(validation, the launcher's checks, scoring), and typing a workload against the schema is
an OmegaConf merge of ~0.04-0.1 s each time, on the command's start-up and its outputs."""


def job_specs(cfg: DictConfig | Any) -> list[JobConfig]:
    """The workload's explicit jobs followed by its generated trace (if any), validated,
    each job's seed offset by ``run.seed``. Each call returns specs of its own (copies):
    callers may change them."""
    workload = OmegaConf.to_container(cfg.workload, resolve=True)
    try:
        key = json.dumps(workload, sort_keys=True, default=repr)
    except TypeError:  # keys that do not sort (int beside str): type it every time
        return _run_seeded(_build_specs(workload), cfg)
    built = _BUILT.get(key)
    if built is None:
        built = _build_specs(workload)  # a ConfigError is raised each time, never kept
        if len(_BUILT) >= 16:
            _BUILT.clear()
        _BUILT[key] = built
    return _run_seeded(copy.deepcopy(built), cfg)


def _run_seeded(specs: list[JobConfig], cfg: DictConfig | Any) -> list[JobConfig]:
    """``run.seed`` added to every job's own seed (its weights, data order, dropout), so
    ``run.seed=0,1,2`` repeats a workload with other random numbers: it used to reach the
    plugins' RunInfo only, and three "seeds" trained alike. A generated trace's arrivals
    and lengths keep ``workload.generate.seed`` (they define the workload)."""
    if isinstance(cfg, DictConfig):
        offset = int(OmegaConf.select(cfg, "run.seed", default=0) or 0)
    else:  # the schema's dataclass, or a config without a run section
        offset = int(getattr(getattr(cfg, "run", None), "seed", 0) or 0)
    check_seed(offset, "run.seed")
    for spec in specs:
        check_seed(spec.seed + offset, f"job '{spec.name}': seed + run.seed"
                   if offset else f"job '{spec.name}': seed")
        spec.seed += offset
    return specs


SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds ``torch.manual_seed`` takes (a larger one raised a raw ``ValueError: Overflow
when unpacking long long`` from inside the run)."""


def check_seed(seed: int, key: str) -> None:
    """Refuse a seed torch cannot take, in one line naming ``key``."""
    low, high = SEED_RANGE
    if not low <= seed <= high:
        raise ConfigError(f"{key} must be in [-2**63, 2**64-1] (torch's seed range), got {seed}")


def _build_specs(workload_container: Any) -> list[JobConfig]:
    # typed against the schema whether the config was composed (typed) or read back from
    # YAML in a rank process (untyped)
    typed = OmegaConf.merge(OmegaConf.structured(AccelConfig), {"workload": workload_container})
    workload = typed.workload
    specs: list[JobConfig] = [OmegaConf.to_object(j) for j in workload.jobs]  # type: ignore[misc]
    gen = workload.generate
    if int(gen.n_jobs) < 0:
        raise ConfigError(f"workload.generate.n_jobs must be >= 0 (0: no generated jobs), got "
                          f"{gen.n_jobs}")
    if gen.n_jobs:
        if not 0 < float(gen.mean_interarrival_s) <= MAX_ARRIVAL_S:
            raise ConfigError(f"workload.generate.mean_interarrival_s must be in (0, "
                              f"{MAX_ARRIVAL_S:g}] seconds, got {gen.mean_interarrival_s}")
        try:
            trace = generate_trace(
                n_jobs=int(gen.n_jobs),
                seed=int(gen.seed),
                mean_interarrival_s=float(gen.mean_interarrival_s),
                models=list(gen.models),
                batch_sizes=list(gen.batch_sizes),
                min_iterations=int(gen.min_iterations),
                max_iterations=int(gen.max_iterations),
                pareto_alpha=float(gen.pareto_alpha),
            )
        except ValueError as exc:
            raise ConfigError(f"workload.generate: {exc}") from None
        specs += [
            JobConfig(
                name=t.name,
                model=t.model,
                dataset=t.dataset,
                batch_size=t.batch_size,
                iterations=t.iterations,
                arrival_s=t.arrival_s,
                seed=t.seed,
                optimizer="adam" if t.model in ("lstm", "transformer") else "sgd",
                lr=1e-3 if t.model in ("lstm", "transformer") else 0.05,
            )
            for t in trace
        ]
    if not specs:
        raise ConfigError("the workload has no jobs; add workload.jobs or workload.generate.n_jobs")
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"workload job names must be unique; repeated: {', '.join(duplicates)}")
    for spec in specs:
        validate_spec(spec)
    return specs


def validate_spec(spec: JobConfig) -> None:
    """One line naming the job and the key for every value a job cannot run with."""
    check_job_name(spec.name)
    where = f"job '{spec.name}'"
    if spec.kind not in KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(KINDS)}, got {spec.kind!r}")
    if spec.optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"{where}: optimizer must be one of {', '.join(OPTIMIZERS)}, got {spec.optimizer!r}"
        )
    if spec.iterations < 1:
        raise ConfigError(f"{where}: iterations must be >= 1, got {spec.iterations}")
    if spec.batch_size < 1:
        raise ConfigError(f"{where}: batch_size must be >= 1, got {spec.batch_size}")
    _check_finite(spec, where)
    if spec.lr <= 0:
        raise ConfigError(f"{where}: lr must be a finite number > 0, got {spec.lr}")
    if not 0 <= spec.momentum < 1:
        raise ConfigError(f"{where}: momentum must be in [0, 1) (SGD's velocity decay; 0.9 is "
                          f"usual), got {spec.momentum}")
    if spec.weight_decay is not None and spec.weight_decay < 0:
        raise ConfigError(f"{where}: weight_decay must be >= 0, got {spec.weight_decay}")
    if spec.lr_schedule not in SCHEDULES:
        raise ConfigError(f"{where}: lr_schedule must be one of {', '.join(SCHEDULES)}, got "
                          f"{spec.lr_schedule!r}")
    if spec.warmup_iterations < 0:
        raise ConfigError(f"{where}: warmup_iterations must be >= 0, got {spec.warmup_iterations}")
    if not 0 <= spec.min_lr <= spec.lr:
        raise ConfigError(f"{where}: min_lr must be in [0, lr={spec.lr}], got {spec.min_lr}")
    if spec.grad_clip is not None and spec.grad_clip <= 0:
        raise ConfigError(f"{where}: grad_clip must be > 0 (or null: no clipping), got "
                          f"{spec.grad_clip}")
    for key in ("model_kwargs", "dataset_kwargs"):
        value = getattr(spec, key)
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(f"{where}: {key} must be a mapping, e.g. {key}={{num_classes:10}}; "
                              f"got {value!r}")
    if spec.loss not in LOSSES:
        raise ConfigError(f"{where}: loss must be one of {', '.join(LOSSES)}, got {spec.loss!r}")
    if spec.precision not in PRECISIONS:
        raise ConfigError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, got "
                          f"{spec.precision!r}")
    if not 0 <= spec.arrival_s <= MAX_ARRIVAL_S:
        raise ConfigError(f"{where}: arrival_s must be in [0, {MAX_ARRIVAL_S:g}] (seconds after "
                          f"the run starts), got {spec.arrival_s}")
    _check_names(spec, where)
    _check_buildable(spec, where)


MAX_ARRIVAL_S = 1e9
"""About 32 years: a later arrival is a typo, and a wait that long overflows the clocks a
driver waits on (``OverflowError: timestamp out of range`` in one process)."""

FLOAT_SETTINGS = {
    "lr": "a finite number > 0",
    "momentum": "a finite number in [0, 1)",
    "weight_decay": "a finite number >= 0, or null",
    "min_lr": "a finite number in [0, lr]",
    "grad_clip": "a finite number > 0, or null (no clipping)",
    "arrival_s": "a finite number >= 0 (seconds after the run starts)",
}
"""A job's float settings and what each takes: ``nan`` and ``inf`` pass every comparison
check written for ordinary numbers (``nan <= 0`` is false), so ``lr=inf`` trained into
nan and ``lr=nan`` was refused as a bad ``min_lr``."""


def _check_finite(spec: JobConfig, where: str) -> None:
    """Refuse a ``nan`` or ``inf`` in any of :data:`FLOAT_SETTINGS`, naming the key."""
    for key, takes in FLOAT_SETTINGS.items():
        value = getattr(spec, key)
        if value is None and "null" in takes:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ConfigError(f"{where}: {key} must be {takes}, got {value}")


def spec_warnings(spec: JobConfig) -> list[str]:
    """One line each for a job's training settings that it accepts but cannot use as
    written, said at the start of the run (``runtime.run.setting_warnings``): typically a
    warm-up or a floor kept from a longer run's settings after shortening the job, or an SGD
    momentum kept after switching the job to Adam (a momentum at its default was never
    chosen, so it is not named). A warning, not a refusal: the job still runs exactly as
    configured."""
    if spec.kind != "train":
        return []
    where, lines = f"job '{spec.name}'", []
    if spec.warmup_iterations >= spec.iterations:
        last = spec.iterations / spec.warmup_iterations
        decay = ("" if spec.lr_schedule == "constant"
                 else f", and its {spec.lr_schedule} decay never starts")
        lines.append(f"{where}: warmup_iterations={spec.warmup_iterations} is not fewer than "
                     f"its {spec.iterations} iterations: the job is all warm-up (its last step "
                     f"at {last:.0%} of lr={spec.lr}){decay}; lower warmup_iterations")
    if spec.min_lr > 0 and spec.lr_schedule == "constant":
        lines.append(f"{where}: min_lr={spec.min_lr} has no effect with lr_schedule=constant; "
                     "lr_schedule=cosine or linear decays to it")
    if spec.optimizer != "sgd" and spec.momentum != JobConfig.momentum:
        lines.append(f"{where}: momentum={spec.momentum} has no effect with "
                     f"optimizer={spec.optimizer} (its betas are its own); optimizer=sgd uses "
                     "it")
    return lines


JOB_NAME_MAX_BYTES = 200
"""The longest job name in UTF-8 bytes: a file name holds 255 bytes, and the name gets an id
prefix (``013-``) and suffixes (``.pt``, a checkpoint's) around it. 100 characters alone let
90 CJK characters (270 bytes) through, and the service's job directory failed with a raw
``File name too long``."""


def check_job_name(name: Any) -> None:
    """A job's name becomes part of its files' names (``weights/<id>.pt``, a checkpoint, a
    service's ``jobs/<id>/``): one that is empty, starts with a dot, holds a path separator
    or a control character, or is too long for a file name would write somewhere else, over
    another job's files, or nowhere, so it is refused."""
    if (not isinstance(name, str) or not name or name.startswith(".") or len(name) > 100
            or len(name.encode("utf-8", "surrogatepass")) > JOB_NAME_MAX_BYTES
            or any(c in name for c in "/\\") or any(ord(c) < 32 for c in name)):
        raise ConfigError(
            f"job name {name!r} cannot name the job's files: use up to 100 characters and "
            f"{JOB_NAME_MAX_BYTES} bytes in UTF-8, no '/' or '\\', no control characters, not "
            "starting with '.' (e.g. name=mlp-a)")


def _check_names(spec: JobConfig, where: str) -> None:
    """The job's model and dataset name something that exists: a zoo name, or a
    ``module:factory`` that imports (not called: building is the job's). Checked with the
    settings, so a cluster run refuses a misspelling before any rank starts instead of in
    every rank."""
    from accelopt.workloads import MODEL_NAMES
    from accelopt.workloads.data import DATASET_NAMES
    from accelopt.workloads.refs import is_ref, resolve_ref

    if spec.dataset is None and is_ref(str(spec.model)):
        raise ConfigError(f"{where}: model {spec.model!r} is a reference: set the job's "
                          "dataset explicitly (a zoo dataset or 'package.module:factory')")
    for what, name, zoo in (("model", spec.model, MODEL_NAMES),
                            ("dataset", spec.dataset, DATASET_NAMES)):
        if name is None:
            continue
        try:
            if is_ref(str(name)):
                resolve_ref(str(name), what)
            elif str(name) not in zoo:
                raise ValueError(f"unknown {what} {name!r}; known {what}s: {', '.join(zoo)}, or "
                                 "'package.module:factory'")
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None


ZOO_DATASET_KINDS = {"synthetic_vectors": "vector", "synthetic_images": "image",
                     "synthetic_sequences": "sequence", "digits": "image"}
"""The kind of input each zoo dataset gives, known by its name (``Dataset.input_kind`` once
built)."""


class _NamedDataset:
    """What :func:`~accelopt.workloads.data.check_compatible` and ``check_rows`` read of a
    dataset, known from a zoo dataset's name without building it."""

    def __init__(self, name: str, input_kind: str, n_train: int | None) -> None:
        self.name, self.input_kind, self.n_train = name, input_kind, n_train


def _check_buildable(spec: JobConfig, where: str) -> None:
    """What building the job would refuse and its settings already tell: a zoo model's
    width, keywords given to a zoo model or dataset (they take none), a zoo model on a zoo
    dataset of the wrong kind, a training batch larger than a synthetic dataset, keywords a
    ``module:factory`` does not take. Checked with the settings because a cluster run builds
    its jobs inside the ranks, after its processes and run directory exist: the same mistake
    refused here is refused before anything starts, in every mode."""
    from accelopt.job.job import check_rows
    from accelopt.workloads import MODEL_NAMES, check_compatible, default_dataset_for
    from accelopt.workloads.data import _DEFAULT_N_TRAIN
    from accelopt.workloads.refs import is_ref, refuse_unknown_keywords

    model, zoo_model = str(spec.model), str(spec.model) in MODEL_NAMES
    if zoo_model and spec.width is not None and (isinstance(spec.width, bool)
                                                 or int(spec.width) < 1):
        raise ConfigError(f"{where}: width must be >= 1 (or null: the model's default), got "
                          f"{spec.width}")
    if zoo_model and spec.model_kwargs:
        raise ConfigError(f"{where}: model_kwargs {dict(spec.model_kwargs)} given for the zoo "
                          f"model {model!r}, which takes width only; model_kwargs are for "
                          "'module:factory' models (drop them)")
    dataset = str(spec.dataset) if spec.dataset is not None else (
        default_dataset_for(model) if zoo_model else None)
    if dataset is None:
        return
    if not is_ref(dataset) and spec.dataset_kwargs:
        raise ConfigError(f"{where}: dataset_kwargs {dict(spec.dataset_kwargs)} given for the "
                          f"zoo dataset {dataset!r}; dataset_kwargs are for 'module:factory' "
                          "datasets (drop them)")
    for what, name, kwargs in (("model", model, spec.model_kwargs),
                               ("dataset", dataset, spec.dataset_kwargs)):
        if is_ref(name) and kwargs:
            try:
                refuse_unknown_keywords(name, what, kwargs)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
    kind = ZOO_DATASET_KINDS.get(dataset)
    if kind is None:
        return
    n_train = _DEFAULT_N_TRAIN if dataset.startswith("synthetic_") else None
    try:
        named = _NamedDataset(dataset, kind, n_train)
        if zoo_model:
            check_compatible(model, named)  # type: ignore[arg-type]
        check_rows(named, spec)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def check_datasets(specs: list[JobConfig]) -> None:
    """Build each job's ``module:factory`` dataset once, in this process, and refuse (one line
    naming the job) what only its data tells: a label that is not a class index, labels of
    a kind cross-entropy cannot take, a held-out set unlike the training set
    (``workloads/adapters.py``). For a cluster run's launcher, before any rank starts: its
    ranks build the jobs, and such a dataset trained there until a batch held the bad label
    (``Target -5 is out of bounds`` after 4 iterations, on every rank). Settings alone cannot
    tell (:func:`_check_buildable`), and a one-process run refuses it as it builds the job,
    before training, so only the cluster launcher pays for this extra build. A factory that
    raises anything but a refusal is left to the ranks, which report it as they build."""
    from accelopt.workloads.data import build_dataset
    from accelopt.workloads.refs import is_ref

    seen: set[str] = set()
    for spec in specs:
        if spec.dataset is None or not is_ref(str(spec.dataset)):
            continue
        kwargs = dict(spec.dataset_kwargs) if spec.dataset_kwargs else None
        key = json.dumps([str(spec.dataset), spec.seed, kwargs], sort_keys=True, default=repr)
        if key in seen:
            continue
        seen.add(key)
        try:
            build_dataset(str(spec.dataset), seed=spec.seed, kwargs=kwargs)
        except ValueError as exc:
            raise ConfigError(f"job '{spec.name}': {exc}") from None
        except UserError:
            raise  # a refusal in its own words (one line)
        except Exception:  # noqa: BLE001, S112 - the ranks build it again and report it
            continue
