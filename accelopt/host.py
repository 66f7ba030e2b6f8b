"""The activated plugins of one run, behind a narrow calling interface.

The runtime never touches pluggy directly: every hook call, whichever shape it has (all
plugins, a chain where each plugin transforms the previous one's output, one plugin's
configure), is made by a *caller* that :meth:`PluginHost._caller` built for that hook when
the host was made. That one factory is the one path of every call:

* it honours pluggy's semantics everywhere: ``tryfirst``/``trylast`` order, *firstresult*,
  and ``@hookimpl(wrapper=True)`` wrappers (for a chained hook a wrapper wraps each plugin's
  link), executing through pluggy itself whenever a wrapper is involved; without one it
  calls the implementations directly, in pluggy's order, each with the arguments it
  declares;
* it serialises the process's hook calls with one lock, so a plugin never sees two of its
  hook calls at once, whether they come from lanes, the transport's receiving threads or
  autograd's thread (a driver whose one thread makes every call may ask for callers without
  it: :meth:`PluginHost.bound`);
* it times the call for the run's timeline (``trace``) and turns a plugin's exception into a
  :class:`PluginHookError` naming the plugin and the hook.

Why callers are built ahead: a job's step fires its events every iteration, and the 1%
overhead goal (``benchmarks/overhead.py``) leaves a few hundred nanoseconds per call. A
caller is one Python frame around the implementation: no dictionary of arguments, no lookup
of the hook by name, no loop where one plugin implements the hook.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pluggy

from accelopt import hookspecs
from accelopt.errors import AccelOptError, PluginHookError, PluginResolutionError
from accelopt.plugin import PluginSpec, hook_methods
from accelopt.records import Span

HOOK_LOCK = threading.RLock()
"""Held around every hook call of this process (reentrant: a hook may trigger another)."""
_acquire, _release = HOOK_LOCK.acquire, HOOK_LOCK.release
_clock = time.perf_counter

Caller = Callable[..., Any]
"""Calls one hook with all its arguments, positionally, in the hookspec's order."""

HookTrace = list
"""The hook calls a run timed, flat: hook, start, end, hook, start, end, ... (seconds of
``time.perf_counter``); :func:`traced_calls` reads it as triples. Flat because a call then
records itself with three appends of objects that already exist, where a ``(hook, start,
end)`` tuple per call is an allocation the cyclic collector must track and later walk: on
the step's six events per iteration that was a tenth of the hook path's cost
(``benchmarks/hook_cost.py``)."""


def traced_calls(trace: HookTrace) -> Iterator[tuple[str, float, float]]:
    """Every call ``trace`` recorded, as (hook, start, end), in the order the calls ended."""
    values = iter(trace)
    return zip(values, values, values, strict=True)


def hook_spans(trace: HookTrace, shift: float, process: str = "executor") -> list[Span]:
    """Every call ``trace`` recorded as a span of the ``hooks`` track of ``process``, its
    times moved by ``shift`` from the hooks' clock (``time.perf_counter``) onto the run's."""
    return [Span(hook, "hooks", start + shift, end + shift, category="hook", process=process)
            for hook, start, end in traced_calls(trace)]


class PluginHost:
    """Owns the pluggy manager with the active plugins registered in activation order."""

    def __init__(self, active: Sequence[tuple[PluginSpec, object]] = ()) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.names: tuple[str, ...] = tuple(spec.name for spec, _ in active)
        self.specs: dict[str, PluginSpec] = {spec.name: spec for spec, _ in active}
        self.instances: dict[str, object] = {}
        # pluggy calls the most recently registered implementation first, so register in
        # reverse to have plugins called in activation (command-line) order.
        for spec, instance in reversed(list(active)):
            _refuse_undecorated(self.pm, spec.name, instance)
            table = _hook_table(instance)
            try:
                self.pm.register(table, name=spec.name)
            except pluggy.PluginValidationError as exc:  # an argument the hookspec lacks
                raise _refused(self.pm, spec.name, table, exc) from None
            self.instances[spec.name] = instance
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:  # a method named like no hook
            raise _unknown_hook(self.pm, exc) from None
        _refuse_implementations_never_run(self.pm)
        self.trace: HookTrace | None = None
        """When a list: every call appends its hook, start and end (:data:`HookTrace`; the
        run's ``hooks`` timeline track)."""
        self._code_owner: dict[object, str] = {}
        self._impls: dict[str, list[Any]] = {}
        self._firstresult: dict[str, bool] = {}
        self._no_answer: dict[str, Any] = {}
        self._spec_args: dict[str, tuple[str, ...]] = {}
        for name in dir(self.pm.hook):
            if not name.startswith("accelopt_"):
                continue
            caller = getattr(self.pm.hook, name)
            firstresult = bool(caller.spec.opts.get("firstresult"))
            self._no_answer[name] = None if firstresult else []
            impls = caller.get_hookimpls()  # pluggy order: called last-first
            if not impls:
                continue
            self._spec_args[name] = tuple(caller.spec.argnames)
            self._impls[name] = impls
            self._firstresult[name] = firstresult
            for impl in impls:
                self._code_owner[getattr(impl.function, "__code__", None)] = impl.plugin_name
        self._implemented = frozenset(self._impls)
        self._callers, self._links = self._callers_of(locked=True)
        self._sinks_nobody_implements = {
            source: sink for sink, source in hookspecs.CHAIN_SOURCES.items()
            if not any(not _wraps(i) for i in self._impls.get(sink, ()))
            and sink in hookspecs.CHAIN_RESULT_CHECKS}
        """Source chain -> the chain its value goes to, where no plugin implements that one
        (an encoder's payload nobody decodes): the source's result gets its check."""
        self._serial: tuple[dict[str, Caller], dict[str, list[tuple[str, Caller]]]] | None = None

    # -- questions ---------------------------------------------------------------------------

    def hooks_of(self, plugin: str) -> frozenset[str]:
        """The hooks the plugin called ``plugin`` implements in this host."""
        return frozenset(hook for hook, impls in self._impls.items()
                         if any(i.plugin_name == plugin for i in impls))

    def hook_code(self) -> dict[object, str]:
        """The code object of every hook implementation, with the plugin that owns it (how
        an error's traceback, or :mod:`accelopt.watchdog`, finds the plugin in a stack)."""
        return self._code_owner

    def implements(self, hook: str) -> bool:
        """Whether any active plugin implements ``hook`` (lets hot paths skip the call)."""
        return hook in self._implemented

    # -- calls -------------------------------------------------------------------------------

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call a hook on every implementing plugin: a list of answers, or the first answer
        that is not ``None`` for a *firstresult* hook."""
        caller = self._callers.get(hook)
        if caller is None:  # nobody implements it: the answer pluggy would give, for free
            return self._no_answer[hook]
        return caller(*self._positional(hook, kwargs))

    def bound(self, hook: str, *, serial: bool = False, answers: bool = True) -> Caller | None:
        """The caller of ``hook``, to be given its arguments positionally in the hookspec's
        order (``None`` when nobody implements it): for the events a job's step or the
        driver fires every iteration, which then pay for no lookup and no keyword dict.

        ``serial=True``: a caller that does not take the hook lock, for a driver that calls
        every hook of the process from one thread (see :meth:`_serial_tables`).

        ``answers=False``: for a caller whose answer is dropped (an event answered by
        ``None``): the answers are still checked, but where one plugin implements the hook
        the caller makes no list of them (an allocation per call, three calls an
        iteration); what it returns then means nothing."""
        caller = (self._serial_tables()[0] if serial else self._callers).get(hook)
        if caller is None or answers or self._firstresult[hook]:
            return caller
        impls = self._impls[hook]
        if len(impls) != 1 or _wraps(impls[0]):
            return caller
        # one implementation: its firstresult caller calls it alike and returns its answer
        return self._caller(hook, impls, True, not serial)

    def _serial_tables(self) -> tuple[dict[str, Caller], dict[str, list[tuple[str, Caller]]]]:
        """The callers and chain links without the hook lock, made on first use.

        Why they exist: the lock serialises calls from several threads (lanes, the
        transport's receiving threads, autograd's); uncontended, its acquire and release are
        still a fifth of a traced call (``benchmarks/hook_cost.py``), paid six times an
        iteration by the step's events. A driver that runs a single job on the thread that
        started the run, with nothing moving between processes (``drivers/local.py``: a
        one-job local run), is the only caller of the process's hooks, so it may use these.
        Every other path keeps the lock."""
        if self._serial is None:
            self._serial = self._callers_of(locked=False)
        return self._serial

    def chain(
        self, hook: str, value: Any, make_kwargs: Callable[[Any], dict[str, Any]], *,
        reverse: bool = False,
    ) -> Any:
        """Call a hook plugin by plugin, building each call's arguments from the value the
        previous plugin returned (``None`` keeps it). Used where several plugins transform
        the same object: layers at build time, payloads in transit, the loss, the optimizer.
        ``reverse`` walks the plugins last-first (decoders undo encoders in reverse)."""
        links = self._links.get(hook)
        if links is None:
            return value
        changed_by = None
        for name, link in reversed(links) if reverse else links:
            out = link(*self._positional(hook, make_kwargs(value)))
            if out is not None:
                value, changed_by = out, name
        check = hookspecs.CHAIN_RESULT_CHECKS.get(hook)
        if check is not None:
            self._check_result(hook, links, value, changed_by, check, make_kwargs)
        sink = self._sinks_nobody_implements.get(hook)
        if sink is not None and changed_by is not None:
            # nobody implements the chain this value goes to: it is what the core uses, so
            # that chain's check applies here, naming the plugin that made it
            expected = hookspecs.CHAIN_RESULT_CHECKS[sink](
                changed_by, value, tuple(self._positional(hook, make_kwargs(value))))
            if expected is not None:
                raise PluginAnswerError(changed_by, hook, value,
                                        f"{expected}: no plugin implements {sink} to turn it "
                                        "back")
        return value

    def _check_result(self, hook: str, links: list[tuple[str, Caller]], value: Any,
                      changed_by: str | None, check: hookspecs.AnswerCheck,
                      make_kwargs: Callable[[Any], dict[str, Any]]) -> None:
        """A chain's final value checked (:data:`hookspecs.CHAIN_RESULT_CHECKS`), naming the
        plugin that gave it. When no link changed what came in, that is the source chain's
        plugins (:data:`hookspecs.CHAIN_SOURCES`: an encoder whose payload no decoder
        undid), else the links that kept it."""
        args = tuple(self._positional(hook, make_kwargs(value)))
        if changed_by is not None:
            expected = check(changed_by, value, args)
            if expected is not None:
                raise PluginAnswerError(changed_by, hook, value, expected)
            return
        source = hookspecs.CHAIN_SOURCES.get(hook)
        givers = sorted({name for name, _ in self._links.get(source, ())} if source else ())
        owner = "' or '".join(givers or sorted({name for name, _ in links}))
        expected = check(owner, value, args)
        if expected is None:
            return
        error = PluginAnswerError(owner, hook, value, expected)
        if givers:
            kept = f"; kept by {' and '.join(sorted({name for name, _ in links}))}"
            error.args = (f"the value after {hook} is {_shown(value)}, as plugin "
                          f"'{owner}' gave it in {source}{kept}; expected {expected}",)
        else:
            error.args = (f"the value after {hook} (plugin '{owner}', which kept it) is "
                          f"{_shown(value)}; expected {expected}",)
        raise error

    def bound_chain(self, hook: str, argument: str, *, serial: bool = False) -> Caller | None:
        """:meth:`chain` for a hot path: a function taking the hook's arguments positionally
        that passes the value of ``argument`` through every plugin in turn and returns the
        last value a plugin gave, or ``None`` when every plugin kept it (``None`` instead of
        a function when nobody implements the hook). With one plugin that is the plugin's
        caller itself: no frame of its own. ``serial``: as for :meth:`bound`."""
        table = self._serial_tables()[1] if serial else self._links
        links = [link for _, link in table.get(hook, ())]
        if not links:
            return None
        if len(links) == 1:
            return links[0]
        slot = self._spec_args[hook].index(argument)

        def through_all(*args: Any) -> Any:
            values, changed = list(args), False
            for link in links:
                out = link(*values)
                if out is not None:
                    values[slot], changed = out, True
            return values[slot] if changed else None

        return through_all

    def call_one(self, plugin: str, hook: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of a hook (each plugin gets its own config)."""
        for name, link in self._links.get(hook, ()):
            if name == plugin:
                try:
                    return link(*self._positional(hook, kwargs))
                except PluginHookError as exc:
                    _name_config_write(exc)
                    raise
        return None

    def _positional(self, hook: str, kwargs: dict[str, Any]) -> list[Any]:
        """A keyword call's arguments in the hookspec's order."""
        try:
            return [kwargs[name] for name in self._spec_args[hook]]
        except KeyError as missing:
            raise TypeError(f"{hook} needs the argument {missing}") from None

    # -- the one path ------------------------------------------------------------------------

    def _callers_of(self, *, locked: bool) -> tuple[dict[str, Caller],
                                                     dict[str, list[tuple[str, Caller]]]]:
        """Every implemented hook's caller, and each plugin's link of it for chains (a link
        is that plugin's implementation with the hook's wrappers, giving its one answer)."""
        callers: dict[str, Caller] = {}
        links: dict[str, list[tuple[str, Caller]]] = {}
        for hook, impls in self._impls.items():
            wrappers = [i for i in impls if _wraps(i)]
            callers[hook] = self._caller(hook, impls, self._firstresult[hook], locked)
            links[hook] = [(i.plugin_name, self._caller(hook, [i, *wrappers], True, locked))
                           for i in reversed(impls) if not _wraps(i)]
            if wrappers and not links[hook]:
                # wrappers alone: one link of them around no implementation (its yield gives
                # None, the value unchanged); without it a wrapper on a chained hook that no
                # plugin implements plainly was never called
                links[hook] = [(wrappers[0].plugin_name,
                                self._caller(hook, wrappers, True, locked))]
        return callers, links

    def _caller(self, hook: str, impls: list[Any], firstresult: bool, locked: bool) -> Caller:
        """The caller of ``hook`` over ``impls`` (pluggy's order, wrappers included), made
        from :data:`_SINGLE` or :data:`_CALLER` for the hook's number of arguments;
        ``locked``: whether it takes the hook lock."""
        spec_args = self._spec_args[hook]
        check = hookspecs.ANSWER_CHECKS.get(hook)
        direct = [i for i in reversed(impls) if not _wraps(i)]
        wrapped = len(direct) != len(impls)
        if len(direct) == 1 and not wrapped:  # the common case: a caller of its own, its
            # check inlined, so an answer of None (most calls) costs one comparison
            return _single_factory(len(spec_args), locked, firstresult, check is not None)(
                hook=hook, impls=impls, single=_invoker(direct[0], spec_args), host=self,
                check=check, single_name=direct[0].plugin_name)
        plain = [_checked(_invoker(i, spec_args), i.plugin_name, hook, check) for i in direct]
        return _caller_factory(len(spec_args), locked)(
            hook=hook, impls=impls, spec_args=spec_args, firstresult=firstresult,
            several=() if wrapped else tuple(plain), wrapped=wrapped,
            hookexec=self.pm._hookexec, host=self, check=check)

    def _check_wrapped(self, hook: str, impls: list[Any], result: Any, firstresult: bool,
                       args: tuple[Any, ...]) -> Any:
        """:func:`_checked` for a call pluggy ran (a wrapper was involved), on the answers it
        gave back: the plugin named is the one implementation called, else all of them."""
        check = hookspecs.ANSWER_CHECKS[hook]
        plain = sorted({i.plugin_name for i in impls if not _wraps(i)})
        owner = plain[0] if len(plain) == 1 else " or ".join(plain)
        for answer in [result] if firstresult else (result or []):
            if answer is not None:
                _check_answer(owner, hook, check, answer, args)
        return result

    def _named(self, exc: AccelOptError, hook: str, impls: list[Any]) -> None:
        """An error a plugin raised on purpose (a ``UserError`` refusing a setting) keeps its
        own message and exit code, and gains the plugin and the hook it came from: with
        several plugins selected, the user must not have to guess which one refused. A
        configure refusal that names its plugin already (``plugins.NAME.key: ...``, the
        documented form) is left as it is: it is about a setting, before anything runs."""
        exc.hook = hook
        if isinstance(exc, PluginHookError):
            return
        owner = self._owner_of(exc, impls)
        text = str(exc)
        if hook == "accelopt_configure" and re.search(rf"\b{re.escape(owner)}\b", text):
            return  # a setting refused up front, named as the docs show (plugins.NAME.key: ...)
        exc.args = (f"{text} [plugin '{owner}', {hook}]",) if text else (
            f"plugin '{owner}' raised {type(exc).__name__} in {hook}",)

    def _owner_of(self, exc: BaseException, impls: list[Any]) -> str:
        """The plugin whose code raised: the deepest frame that belongs to one, else the only
        plugin called."""
        tb = exc.__traceback__
        owner = None
        while tb is not None:
            name = self._code_owner.get(tb.tb_frame.f_code)
            if name is not None:
                owner = name
            tb = tb.tb_next
        if owner is None:
            plain = {i.plugin_name for i in impls if not _wraps(i)}
            owner = plain.pop() if len(plain) == 1 else "<unknown>"
        return owner


_SINGLE = """
def make(hook, impls, single, host, check, single_name):
    def call({args}):
        trace = host.trace{acquire}
        try:
            if trace is None:
                answer = single({args})
            else:
                start = _clock()
                try:
                    answer = single({args})
                finally:  # three appends, no tuple: see HookTrace
                    trace.append(hook)
                    trace.append(start)
                    trace.append(_clock()){check}
        except AccelOptError as exc:
            if getattr(exc, "hook", None) is None:  # raised by a hook, on purpose
                host._named(exc, hook, impls)
            raise
        except Exception as exc:
            raise PluginHookError(host._owner_of(exc, impls), hook, exc) from exc{release}
        return {answered}
    return call
"""
"""The caller of a hook one plugin implements without a wrapper (every per-iteration event
in the common case), as source: each hook gets a caller with exactly as many positional
parameters as its hookspec has arguments, because a call through ``*args`` costs a tuple
and an extra interpreter frame; and only the lines its case needs (the lock, the answer's
check, the list a non-*firstresult* hook returns), because a branch not taken still costs
its bytecodes six times an iteration (``benchmarks/hook_cost.py`` counts them)."""

_CALLER = """
def make(hook, impls, spec_args, firstresult, several, wrapped, hookexec, host, check):
    def call({args}):
        trace = host.trace{acquire}
        start = _clock() if trace is not None else 0.0
        try:
            if wrapped:  # a wrapper is involved: pluggy runs it
                result = hookexec(hook, impls, dict(zip(spec_args, ({args}{comma}))), firstresult)
                if check is None:
                    return result
                return host._check_wrapped(hook, impls, result, firstresult, ({args}{comma}))
            answers = []
            for each in several:
                answer = each({args})
                if answer is not None:
                    if firstresult:
                        return answer
                    answers.append(answer)
            return None if firstresult else answers
        except AccelOptError as exc:
            if getattr(exc, "hook", None) is None:  # raised by a hook, on purpose
                host._named(exc, hook, impls)
            raise
        except Exception as exc:
            raise PluginHookError(host._owner_of(exc, impls), hook, exc) from exc
        finally:
            if trace is not None:
                trace.append(hook)
                trace.append(start)
                trace.append(_clock())
            {release_line}
    return call
"""
"""The caller of a hook several plugins implement, or one with a wrapper (then pluggy runs
the call): the same contract as :data:`_SINGLE`."""

def _compiled(source: str, name: str) -> Callable[..., Caller]:
    """``make`` of a caller template's ``source``, its globals the hook path's own."""
    namespace = {"_acquire": _acquire, "_release": _release, "_clock": _clock,
                 "AccelOptError": AccelOptError, "PluginHookError": PluginHookError,
                 "_check_answer": _check_answer}
    exec(compile(source, f"<accelopt.host {name}>", "exec"), namespace)
    return namespace["make"]  # type: ignore[no-any-return]


def _arguments(arity: int) -> tuple[str, str]:
    """The parameter list of a caller of ``arity`` arguments, and the comma that makes a
    tuple of one of them."""
    return ", ".join(f"a{i}" for i in range(arity)), "," if arity == 1 else ""


@functools.cache
def _single_factory(arity: int, locked: bool, firstresult: bool,
                    checked: bool) -> Callable[..., Caller]:
    """``make`` of :data:`_SINGLE` for one case (compiled once each)."""
    args, comma = _arguments(arity)
    source = _SINGLE.format(
        args=args,
        acquire="\n        _acquire()  # not `with`: a third of the cost" if locked else "",
        release="\n        finally:\n            _release()" if locked else "",
        check=("\n            if answer is not None:\n                _check_answer(single_name, "
               f"hook, check, answer, ({args}{comma}))" if checked else ""),
        answered="answer" if firstresult else "[] if answer is None else [answer]")
    return _compiled(source, f"caller of {arity} arguments")


@functools.cache
def _caller_factory(arity: int, locked: bool) -> Callable[..., Caller]:
    """``make`` of :data:`_CALLER` for hooks of ``arity`` arguments (compiled once each)."""
    args, comma = _arguments(arity)
    source = _CALLER.format(args=args, comma=comma,
                            acquire="\n        _acquire()" if locked else "",
                            release_line="_release()" if locked else "pass")
    return _compiled(source, f"caller of {arity} arguments, several plugins")


class _HookTable:
    """What pluggy registers in a plugin object's place: its hook methods, bound, as
    attributes (see :func:`_hook_table`)."""


def _hook_table(plugin: object) -> object:
    """What to register with pluggy for ``plugin``: for an instance, a table of its bound
    hook methods found on its class; a module or a class as it is.

    Why not the instance itself: pluggy discovers implementations with ``dir()`` and
    ``inspect.getattr_static`` on the object, and both read its ``__dict__``, which makes
    CPython give the instance a real dictionary in place of its compact attribute values,
    and every ``self.x`` in that plugin's hooks gets slower (a noop hook that increments one
    attribute: 1,333 instead of 683 instructions a call, ``benchmarks/hook_cost.py``). The table
    is found on the class, which never touches the instance's attributes. A hook marked
    above a ``staticmethod`` or ``classmethod`` keeps its marker off the function, so such
    a plugin is registered as it is (correct, only slower)."""
    if inspect.ismodule(plugin) or inspect.isclass(plugin):
        return plugin
    table = _HookTable()
    for method in hook_methods(plugin):
        if not method.marked:
            continue
        if method.wrapped:
            return plugin
        setattr(table, method.attribute, getattr(plugin, method.attribute))
    return table


HOOK_DOCS = "docs/hooks.md"


def _refuse_undecorated(pm: pluggy.PluginManager, plugin: str, found_on: object) -> None:
    """A method named like a hook (``accelopt_*``) but not marked ``@hookimpl``, refused in
    one line naming the plugin, the method and the fix. Why: pluggy registers only marked
    functions (this project's manager adds no naming convention, unlike pytest's), so such a
    method is never called and the run went on with exit 0 as if the plugin worked. The
    conformance kit (``accelopt.testing``) refuses the same methods.

    Read on the class of an instance (never the instance: see :func:`_hook_table`), or on a
    module or class registered as it is; a staticmethod or classmethod counts as marked when
    either it or its function carries the marker."""
    project = pm.project_name
    for method in hook_methods(found_on):
        name = method.attribute
        if method.marked or not name.startswith(f"{project}_"):
            continue
        caller = getattr(pm.hook, name, None)
        where = f"plugin '{plugin}': {name}"
        if caller is not None and caller.spec is not None:
            raise PluginResolutionError(
                f"{where} is not decorated with @hookimpl, so it is never called; decorate "
                f"it with @hookimpl (from accelopt import hookimpl) ({HOOK_DOCS})")
        known = [h for h in dir(pm.hook) if h.startswith(f"{project}_")
                 and getattr(pm.hook, h).spec is not None]
        close = difflib.get_close_matches(name, known, n=1)
        meant = f"rename it to {close[0]} and " if close else "name it after a hook and "
        raise PluginResolutionError(
            f"{where} is named like a hook but is no accelopt hook and has no @hookimpl, so it "
            f"is never called; {meant}decorate it with @hookimpl if it is meant as one, else "
            f"rename it without the {project}_ prefix ({HOOK_DOCS})")


def _refused(pm: pluggy.PluginManager, plugin: str, table: object,
             exc: pluggy.PluginValidationError) -> PluginResolutionError:
    """pluggy's several-line refusal of one implementation (an argument the hookspec does
    not have) as one line naming the plugin, the hook and the arguments it may declare: a
    plugin author's mistake is input, not a crash of accelopt."""
    hook = re.search(r"for hook '([^']+)'", str(exc))
    caller = getattr(pm.hook, hook.group(1), None) if hook else None
    if caller is None or caller.spec is None:
        return PluginResolutionError(
            f"plugin '{plugin}' cannot be registered: {' '.join(str(exc).split())}")
    wanted = inspect.signature(getattr(table, hook.group(1))).parameters
    extra = [name for name in wanted if name not in caller.spec.argnames and name != "self"]
    return PluginResolutionError(
        f"plugin '{plugin}': {hook.group(1)} declares {', '.join(extra) or 'an argument'}, "
        f"which the hook does not pass; declare any of ({', '.join(caller.spec.argnames)}) "
        f"({HOOK_DOCS})")


def _unknown_hook(pm: pluggy.PluginManager,
                  exc: pluggy.PluginValidationError) -> PluginResolutionError:
    """``check_pending``'s refusal ("unknown hook ... in plugin <object>") as one line that
    names the plugin, the method and the hook it most likely meant."""
    plugin = pm.get_name(exc.plugin) or "<unnamed>"
    known = [name for name in dir(pm.hook) if name.startswith(f"{pm.project_name}_")
             and getattr(pm.hook, name).spec is not None]
    unknown = sorted(name for name in dir(pm.hook) if name.startswith(f"{pm.project_name}_")
                     and getattr(pm.hook, name).spec is None
                     and any(i.plugin is exc.plugin for i in getattr(pm.hook, name).get_hookimpls()))
    method = unknown[0] if unknown else "a method"
    close = difflib.get_close_matches(method, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else f"; the hooks are listed in {HOOK_DOCS}"
    return PluginResolutionError(
        f"plugin '{plugin}' implements {method}, which is not an accelopt hook{hint}")


def _refuse_implementations_never_run(pm: pluggy.PluginManager) -> None:
    """Implementations pluggy accepts but that would do nothing, in silence, each refused in
    one line naming the plugin and the hook: one giving a hook's argument a default (pluggy
    passes only the arguments named without defaults: it always sees the default); an
    ``async def`` or a generator that is no wrapper (the core calls hooks synchronously:
    calling one only makes a coroutine or a generator, and its body never runs)."""
    for hook in dir(pm.hook):
        caller = getattr(pm.hook, hook)
        if not hook.startswith(f"{pm.project_name}_") or caller.spec is None:
            continue
        for impl in caller.get_hookimpls():
            where = f"plugin '{impl.plugin_name}': {hook}"
            defaulted = [a for a in impl.kwargnames if a in caller.spec.argnames]
            if defaulted:
                raise PluginResolutionError(
                    f"{where} gives argument '{defaulted[0]}' a default, so the hook never "
                    f"passes it (it always sees the default); remove the default ({HOOK_DOCS})")
            function = impl.function
            if inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function):
                raise PluginResolutionError(
                    f"{where} is async: hooks are called synchronously and a coroutine is "
                    f"never awaited, so its body would never run; make it a plain def "
                    f"({HOOK_DOCS})")
            if inspect.isgeneratorfunction(function) and not _wraps(impl):
                raise PluginResolutionError(
                    f"{where} is a generator (it yields), so its body would never run; "
                    f"return its answer, or mark it @hookimpl(wrapper=True) if it wraps the "
                    f"other plugins' calls ({HOOK_DOCS})")


def _wraps(impl: Any) -> bool:
    """Whether a pluggy implementation is a wrapper (new or old style)."""
    return bool(impl.wrapper or impl.hookwrapper)


def _name_config_write(exc: PluginHookError) -> None:
    """A plugin assigning to the read-only run config (``accelopt_configure``'s
    ``run_config``): OmegaConf's error runs to four lines (``full_key:``,
    ``reference_type=``...); make it one, naming the key and the fix."""
    from omegaconf.errors import ReadonlyConfigError

    if isinstance(exc.error, ReadonlyConfigError):
        key = getattr(exc.error, "full_key", None)
        where, flag = (f"run_config.{key}", f"{key}=...") if key else ("run_config", "it")
        exc.args = (f"plugin '{exc.plugin}' raised in hook {exc.hook}: ReadonlyConfigError: "
                    f"it assigned to {where}, which is read-only to plugins; keep the value "
                    f"in the plugin (self.x = ...), or set {flag} on the command line",)


class PluginAnswerError(PluginHookError):
    """A plugin answered a hook with a value the core cannot use (a wrong type, a job that is
    not ready, rows under another plugin's name): named where it was given, not where the
    core later trips over it."""

    def __init__(self, plugin: str, hook: str, answer: Any, expected: str) -> None:
        super().__init__(plugin, hook, TypeError(expected))
        self.args = (f"plugin '{plugin}' answered {hook} with {_shown(answer)}; "
                     f"expected {expected}",)


def _shown(answer: Any) -> str:
    """A wrong answer in a few words: its type and a short repr."""
    text = " ".join(repr(answer).split())  # one line: an optimizer's repr has several
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(answer).__name__} {text}"


def _check_answer(plugin: str, hook: str, check: hookspecs.AnswerCheck, answer: Any,
                  args: tuple[Any, ...]) -> None:
    """Raise :class:`PluginAnswerError` unless ``check`` accepts ``plugin``'s answer."""
    expected = check(plugin, answer, args)
    if expected is not None:
        raise PluginAnswerError(plugin, hook, answer, expected)


def _checked(invoke: Caller, plugin: str, hook: str,
             check: hookspecs.AnswerCheck | None) -> Caller:
    """``invoke`` with its answer checked by the hook's :data:`hookspecs.ANSWER_CHECKS`
    entry (``invoke`` itself for a hook without one: no frame where none is needed); the
    path of several plugins (one plugin's check is inlined in the caller)."""
    if check is None:
        return invoke

    def checked(*args: Any) -> Any:
        answer = invoke(*args)
        if answer is not None:
            _check_answer(plugin, hook, check, answer, args)
        return answer

    return checked


def _invoker(impl: Any, spec_args: tuple[str, ...]) -> Caller:
    """A function taking the hook's arguments positionally, in the hookspec's order, that
    calls the implementation with those it declares, as pluggy would: the implementation
    itself where it declares all of them, in order (the cheapest call)."""
    function = impl.function
    if tuple(impl.argnames) == spec_args:
        return function  # type: ignore[no-any-return]
    positions = tuple(spec_args.index(n) for n in impl.argnames)

    def with_its_arguments(*args: Any) -> Any:
        return function(*[args[p] for p in positions])

    return with_its_arguments
