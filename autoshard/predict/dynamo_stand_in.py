"""Profiles on fake tensors without importing ``torch._dynamo`` (1.2 s of CPU, a third of a 70B
estimate, for nothing a forward on fake tensors uses; torch 2.13): :func:`without_dynamo` runs a
profile with a stand-in module that gives dynamo's config and a no-op ``disable``, and runs it
again with the real dynamo if it asked for anything more, so the result is the real one's
either way. Tests: ``tests/predict/test_dynamo_stand_in.py`` (fresh interpreters)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def without_dynamo(run: Callable[..., _T], *args: Any) -> _T:
    """``run(*args)`` without importing ``torch._dynamo`` where nothing has yet, or, if the run
    needed more of dynamo than the stand-in gives (:class:`_DynamoStandIn`), ``run(*args)`` again
    with the real one: the result is the real one's either way.

    Nothing compiles in a profile, yet two things import all of dynamo (1.2 s of CPU, a third of
    a 70B estimate; torch 2.13): a ``FakeTensorMode`` reads three switches of
    ``torch._dynamo.config``, and torch's Python meta kernels are wrapped in
    ``torch._disable_dynamo``, whose first call imports dynamo only to wrap the kernel in
    ``torch._dynamo.disable``, which changes nothing while no frame is being compiled. A fake
    forward needs more only where the fake mode converts a real or meta tensor (its converter
    names tensors with ``torch._dynamo.source``): :func:`fake_model` makes its tensors afresh."""
    if "torch._dynamo" in sys.modules:
        return run(*args)
    try:
        stand_in = _DynamoStandIn()
    except Exception:  # a torch laid out otherwise: the real dynamo, as before
        return run(*args)
    outcome: tuple[_T] | None = None
    try:
        outcome = (run(*args),)
    except Exception:
        if not stand_in.needed:
            raise
    finally:
        stand_in.withdraw()
    if outcome is not None and not stand_in.needed:
        return outcome[0]
    # what ran may have met a missing module (and an error, or another path): again, for real
    importlib.import_module("torch._dynamo")
    return run(*args)


class _DynamoStandIn(types.ModuleType):
    """``sys.modules["torch._dynamo"]`` while :func:`without_dynamo` runs: its ``config`` (torch's
    own module, loaded alone), and a ``disable`` that returns the function itself. Anything else
    (an attribute, a submodule) sets :attr:`needed`; an attribute is then the real dynamo's.

    On :meth:`withdraw` the functions ``torch._disable_dynamo`` cached undisabled are reset, so
    that their next call imports the real dynamo and disables them as torch does."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("torch._dynamo")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("torch._dynamo is not a package here")
        super().__init__(spec.name)
        self.__spec__ = spec
        self.__file__ = spec.origin
        self.__path__: list[str] = []  # submodules are found by find_spec below, or not at all
        self.config = _dynamo_config(list(spec.submodule_search_locations))
        self.needed = ""  # what was asked for that the stand-in does not give
        self._undisabled: list[Any] = []
        self._withdrawn = False
        sys.modules[self.__name__] = self
        sys.meta_path.insert(0, self)

    def disable(self, fn: Any, recursive: bool = True, wrapping: bool = True) -> Any:
        """``torch._dynamo.disable`` while dynamo is not loaded: nothing to disable."""
        self._undisabled.append(fn)
        return fn

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        """As a finder on ``sys.meta_path``: note a submodule asked for (none is found)."""
        if name.startswith(f"{self.__name__}.") and not self._withdrawn:
            self.needed = self.needed or name

    def withdraw(self) -> None:
        """Take the stand-in out of ``sys.modules`` and ``sys.meta_path``."""
        if self._withdrawn:
            return
        self._withdrawn = True
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for fn in self._undisabled:
            if getattr(fn, "__dynamo_disable", None) is fn:
                delattr(fn, "__dynamo_disable")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system's and inspect's probes
            raise AttributeError(name)
        self.needed = self.needed or f"{self.__name__}.{name}"
        self.withdraw()
        return getattr(importlib.import_module(self.__name__), name)


def _dynamo_config(locations: list[str]) -> types.ModuleType:
    """``torch._dynamo.config``, loaded alone where dynamo is not (it imports nothing of
    dynamo); the real dynamo takes it from ``sys.modules`` when it loads."""
    name = "torch._dynamo.config"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.machinery.PathFinder.find_spec(name, locations)
    if spec is None or spec.loader is None:
        raise ImportError(f"no {name} in {locations}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
