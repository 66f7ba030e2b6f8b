"""``"package.module:factory"`` references: workloads may name a model or dataset built elsewhere.

The zoo knows its own names; anything else a workload needs (a plugin's sparse dataset, a
user's model, a model library's constructor) is named by an import reference and built by
calling the factory. This keeps the core free of any plugin import while letting a workload
run unchanged with or without the plugin that optimises it.

What a factory is called with (:func:`call_factory`): the job's ``model_kwargs`` /
``dataset_kwargs``, plus each *standard* keyword the core knows (a model's ``input_shape``,
``num_classes``, ``vocab_size``, ``width``; a dataset's ``seed``, ``n_train``) that the
factory's signature names (a job has no ``n_train``: only a direct ``build_dataset(n_train=)``
call gives one). A factory that names none of them gets only the user's keywords,
so a library constructor such as ``torchvision.models:resnet18`` (which passes ``**kwargs``
on to its class) works as it is, with ``model_kwargs={num_classes: 10}``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import traceback
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

from accelopt.errors import error_text


def is_ref(name: str | None) -> bool:
    """A reference has the form ``module.path:attribute`` (zoo names never contain ':')."""
    return bool(name) and ":" in str(name)


def resolve_ref(ref: str, what: str) -> Callable[..., Any]:
    """Import the factory ``ref`` points to, or raise ``ValueError`` in one line that says why."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not all(p.isidentifier() for p in attr.split(".")):
        raise ValueError(f"{what} reference {ref!r} must look like 'package.module:factory'")
    try:
        module = import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} reference {ref!r}: cannot import {module_name!r} ({exc})"
                         f"{import_path_fix(exc, module_name, 'accelopt run')}") from None
    except Exception as exc:  # the user's module is broken: one line, where (--debug: chain)
        raise ValueError(f"{what} reference {ref!r}: importing {module_name!r} raised "
                         f"{import_error(exc)}") from exc
    factory: Any = module
    for part in attr.split("."):  # 'module:Class.from_config' names an attribute's attribute
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise ValueError(f"{what} reference {ref!r}: {module_name!r} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def import_path_fix(exc: BaseException, module_name: str, command: str) -> str:
    """The fix when the reference's own top-level package is not found: ``command`` (a
    console script: ``accelopt run``, ``accelopt serve``) does not import from the directory
    it was started in, so a user's package beside them (``mypkg/nets.py``) was "No module
    named 'mypkg'" with no word of why. ``""`` when the missing module is another (a
    dependency the user's module imports, a submodule): the error names that one."""
    top = module_name.partition(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or exc.name != top:
        return ""
    holding = f"{top}/" if "." in module_name else f"{top}.py or {top}/"
    return (f"; install it, or put the directory holding {holding} on the import path "
            f"(PYTHONPATH=<that directory> {command} ...): {command} does not import from "
            "the directory it was started in")


def import_error(exc: BaseException) -> str:
    """A module's failure to import, in one line with where it is: ``file:line`` of a
    SyntaxError, else the module's own line that raised (the first frame of the traceback
    outside importlib and this file). Only ImportError was caught: a SyntaxError or an error
    at the module's top level went out as a traceback (Hydra's, exit 1), and out of
    ``accelopt.run`` as itself rather than a ``UserError``."""
    if isinstance(exc, SyntaxError):
        where = f"{exc.filename}:{exc.lineno}: " if exc.filename else ""
        return f"{where}{type(exc).__name__}: {exc.msg}"
    importlib_dir = os.path.dirname(importlib.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(("<frozen", importlib_dir))
              and f.filename != __file__]
    where = f" at {frames[0].filename}:{frames[0].lineno}" if frames else ""
    return f"{error_text(exc)}{where}"


def refuse_unknown_keywords(ref: str, what: str, extra: Mapping[str, Any]) -> None:
    """The user's keywords ``extra`` against the signature of the factory ``ref`` names,
    without calling it: one it does not take raises ``ValueError`` in one line, as
    :func:`call_factory` would once the job is built. Checked with the settings because a
    cluster run builds its jobs inside the ranks, after its processes have started. A
    factory without a signature, or taking ``**kwargs``, takes any."""
    try:
        params = inspect.signature(resolve_ref(ref, what)).parameters
    except (TypeError, ValueError):  # no signature (a builtin), or refused where it is built
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in extra if k not in params
               or params[k].kind is inspect.Parameter.POSITIONAL_ONLY]
    if unknown:
        takes = ", ".join(params) or "no keywords"
        raise ValueError(f"{what} {ref!r} cannot be called with {', '.join(extra)}: it takes "
                         f"no keyword {unknown[0]!r} (it takes {takes}); set {what}_kwargs to "
                         "what it takes")


def call_factory(ref: str, what: str, standard: Mapping[str, Any],
                 extra: Mapping[str, Any] | None) -> Any:
    """Build with the factory ``ref`` names: ``extra`` (the user's keywords) plus those of
    ``standard`` its signature names and the core has a value for (a keyword in both: the
    user's wins; one the core has no value for, ``None``, is left to the factory's default
    where it has one: ``n_train=None`` overrode ``def data(*, n_train=512)``). A factory that
    rejects its arguments raises ``ValueError`` in one line naming what it was given; an
    error from inside it, one naming the factory and the error."""
    factory = resolve_ref(ref, what)
    extra = dict(extra or {})
    try:
        signature: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: the user's keywords only
        signature = None
    params = signature.parameters if signature is not None else {}
    named = {k: v for k, v in standard.items() if k in params and k not in extra
             and (v is not None or params[k].default is inspect.Parameter.empty)}
    kwargs = {**named, **extra}
    try:  # the arguments against its signature, apart from the call: a TypeError from inside
        # the factory (a typo in the user's own code) read as the factory refusing them
        if signature is not None:
            signature.bind(**kwargs)
    except TypeError as exc:
        given = ", ".join(kwargs) or "no arguments"
        raise ValueError(f"{what} {ref!r} cannot be called with {given}: {exc}; set "
                         f"{what}_kwargs to what it takes") from None
    try:
        return factory(**kwargs)
    except Exception as exc:  # the user's own code raised: one line (--debug: the chain)
        raise ValueError(f"{what} {ref!r} raised {error_text(exc)}") from exc
