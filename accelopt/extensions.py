"""Extension points: named objects that other packages contribute to a plugin, without
importing it.

A plugin that wants to be extended (salus and its scheduling policies) publishes an
*entry-point group*; a package adds to it by declaring an entry point in that group and
installing itself, exactly as plugins are found through ``accelopt.plugins``::

    [project.entry-points."accelopt_salus.policies"]
    lifo = "accelopt_lifo:Lifo"

The plugin reads its group through :func:`extension_point`, which is the same in the parent
process, in every rank of a cluster run, in ``run.compare`` reference runs and in
``accelopt bench`` sets, because all of them discover installed packages the same way.
Objects registered in code (``extension_point(group).register(name, obj)``, e.g. by a
decorator at import time) are sent to a cluster run's rank processes along with the run, so
they are found there too. A name means one object: a different object registered in code
under a name taken in code is refused at once; a name an installed package declares and
code registers too, or two installed packages declare, is refused in one line naming both
when it is used, while every other name keeps working.

The plugin that publishes a group registers its own objects as *built-ins*
(``register(name, obj, builtin=True)``). A built-in's name is never the one to rename: an
installed package or code elsewhere that takes it, whichever was imported first, is refused
in one line naming both, and telling that other party to rename, where the name is used;
every other name, the built-in's other names included, keeps working.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

from accelopt.errors import UserError


class ExtensionPoint:
    """The named objects of one entry-point group: installed ones (loaded lazily) plus the
    ones registered in code."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._registered: dict[str, Any] = {}
        self._builtin: dict[str, Any] = {}
        """name -> the publishing plugin's own object: refused to nobody, never renamed."""
        self._entry_points: dict[str, list[EntryPoint]] | None = None
        self._clashes: dict[str, str] = {}
        """name -> the one-line refusal of an object registered in code under a name an
        installed package declares: raised when the name is used, not at registration (a
        plugin registering its own names at import would otherwise stop working entirely)."""

    def _installed(self) -> dict[str, list[EntryPoint]]:
        """name -> the distinct entry points declaring it (one, unless packages clash)."""
        if self._entry_points is None:
            found: dict[str, list[EntryPoint]] = {}
            for ep in entry_points(group=self.group):
                same = found.setdefault(ep.name, [])
                if all(other.value != ep.value for other in same):
                    same.append(ep)
            self._entry_points = found
        return self._entry_points

    def register(self, name: str, obj: Any, *, builtin: bool = False) -> Any:
        """Add ``obj`` under ``name``; registering the same object again is a no-op. Another
        object under a name taken in code is a :class:`UserError` at once; under a name an
        installed package declares, the clash is recorded and refused, in one line naming
        both (the package by its distribution name, so the line says what to rename or
        uninstall), only where the name is used (:meth:`get`): every other name keeps
        working, as for a name two installed packages declare.

        ``builtin``: ``obj`` is the publishing plugin's own. Anyone else's object under that
        name, registered before or after it, is refused where the name is used, naming the
        other one as what to rename: a third party's module imported first must not make
        the plugin's own registration fail, and with it every name of the group."""
        if not isinstance(name, str) or not name.isidentifier():
            raise UserError(f"{self.group}: extension name {name!r} must be an identifier")
        if builtin:
            return self._register_builtin(name, obj)
        if self._builtin.get(name) is obj:
            return obj  # the built-in itself again (a rank restoring, a re-decorated class)
        taken = self._registered.get(name)
        declared = self._installed().get(name, ())
        loaded = taken is not None and any(ep.value == _reference(taken) for ep in declared)
        if taken is not None and taken is not obj and not loaded:
            raise UserError(f"{self.group}: '{name}' is already registered ({_where(taken)}); "
                            f"register {_where(obj)} under another name")
        others = [ep for ep in declared if ep.value != _reference(obj)]
        if others and (taken is None or loaded):  # whether or not the package's was loaded
            self._clashes[name] = (
                f"{self.group}: '{name}' is installed by "
                f"{'; '.join(_declared_by(ep) for ep in others)} and registered in code by "
                f"{_where(obj)}; a name means one object: rename one of them (or uninstall "
                "that package)")
        self._registered[name] = obj
        return obj

    def _register_builtin(self, name: str, obj: Any) -> Any:
        """Record the publishing plugin's own ``obj``: two of its own under one name is its
        own bug, refused at once; anyone else's is judged where the name is used."""
        own = self._builtin.get(name)
        if own is not None and own is not obj:
            raise UserError(f"{self.group}: built-in '{name}' is already {_where(own)}; "
                            f"register {_where(obj)} under another name")
        self._builtin[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        """Forget an object registered in code (tests, notebooks); installed ones and
        built-ins stay."""
        self._registered.pop(name, None)
        self._clashes.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._builtin or name in self._registered
                                          or name in self._installed())

    def names(self) -> list[str]:
        """Every name: built in, registered in code or installed (clashing ones too)."""
        return sorted(set(self._builtin) | set(self._registered) | set(self._installed()))

    def clashing(self) -> list[str]:
        """The names :meth:`get` refuses because two objects claim them: not choices to
        offer until one is renamed."""
        return [name for name in self.names() if self._refusal(name) is not None]

    def _refusal(self, name: str) -> str | None:
        """The one-line refusal of ``name`` when more than one object claims it, else
        ``None``."""
        if name in self._builtin:
            return self._builtin_refusal(name)
        clash = self._clashes.get(name)
        if clash is not None:  # code and a package both claim it: not ours to pick one
            return clash
        installed = self._installed().get(name) or []
        if len(installed) > 1:  # two packages declare it: which one is meant is not ours to guess
            return (f"{self.group}: '{name}' is installed by {len(installed)} packages "
                    f"({'; '.join(_declared_by(ep) for ep in installed)}); uninstall one "
                    "of them or rename its entry point")
        return None

    def _builtin_refusal(self, name: str) -> str | None:
        """Who else claims the built-in ``name`` (code registering it, a package declaring
        it), as one line telling them, never the built-in, to rename; ``None`` if nobody."""
        own = self._builtin[name]
        code = self._registered.get(name)
        installed = [ep for ep in self._installed().get(name, ()) if ep.value != _reference(own)]
        if code is not None and any(ep.value == _reference(code) for ep in installed):
            code = None  # the package's object, loaded: named as the package below
        claims, fixes = [], []
        if installed:
            claims.append(f"installed by {'; '.join(_declared_by(ep) for ep in installed)}")
            fixes.append("rename that package's entry point (or uninstall it)")
        by = [_where(own)]
        if code is not None and code is not own:
            by.insert(0, _where(code))
            fixes.append(f"register {_where(code)} under another name")
        if not fixes:
            return None
        claims.append(f"registered in code by {' and by '.join(by)}")
        return (f"{self.group}: '{name}' is {' and '.join(claims)}; a name means one object and "
                f"the built-in ({_where(own)}) keeps it: {' and '.join(fixes)}")

    def get(self, name: str) -> Any | None:
        """The object called ``name`` (an installed one is imported now), or ``None``. An
        installed entry point that fails to import, and a name two objects claim
        (:meth:`_refusal`), is a :class:`UserError` saying so."""
        refusal = self._refusal(name)
        if refusal is not None:
            raise UserError(refusal)
        if name in self._builtin:
            return self._builtin[name]
        installed = self._installed().get(name) or []
        if name in self._registered:
            return self._registered[name]
        if not installed:
            return None
        (ep,) = installed
        try:
            obj = ep.load()
        except Exception as exc:  # a third party's bug becomes one line, not a traceback
            raise UserError(f"{self.group}: '{name}' ({ep.value}) is installed but failed to "
                            f"load ({type(exc).__name__}: {exc}); reinstall that package") from None
        self._registered[name] = obj
        return obj

    def registered_in_code(self) -> dict[str, Any]:
        """What was registered in this process (not merely loaded from an entry point, nor a
        built-in, which the plugin registers again wherever it is imported)."""
        installed = self._installed()
        return {n: o for n, o in self._registered.items()
                if all(ep.value != _reference(o) for ep in installed.get(n, ()))}


_POINTS: dict[str, ExtensionPoint] = {}


def extension_point(group: str) -> ExtensionPoint:
    """The process-wide extension point of ``group`` (created on first use)."""
    point = _POINTS.get(group)
    if point is None:
        point = _POINTS[group] = ExtensionPoint(group)
    return point


def code_extensions() -> dict[str, dict[str, Any]]:
    """group -> name -> object for everything registered in code in this process: what a
    cluster run sends to its ranks (objects travel by reference, so they must be defined at
    module level)."""
    return {g: p.registered_in_code() for g, p in _POINTS.items() if p.registered_in_code()}


def restore_code_extensions(snapshot: dict[str, dict[str, Any]]) -> None:
    """Register a parent's :func:`code_extensions` in this process (a rank)."""
    for group, objects in snapshot.items():
        point = extension_point(group)
        for name, obj in objects.items():
            point.register(name, obj)


def _reference(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"


def _where(obj: Any) -> str:
    return _reference(obj)


def _declared_by(ep: EntryPoint) -> str:
    """'package: module:attr' for an error naming who declared an entry point."""
    dist = getattr(ep, "dist", None)
    return f"{dist.name if dist is not None else 'a package'}: {ep.value}"
