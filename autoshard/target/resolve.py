"""Resolve a model target (``path/to/file.py:callable`` or ``package.module:callable``).

The callable takes keyword arguments only (given on the command line as ``--arg key=value``)
and returns an ``nn.Module``, or a ``(module, batch)`` tuple where ``batch`` is an example input
for one training step or the user's data (a DataModule, DataLoader or iterable of batches:
:mod:`autoshard.target.data`). It is called under the meta device so that a 70B model costs
no memory; a factory that cannot be built on meta falls back to the CPU with a warning, given
before the build, and only when it fits in the free memory (:func:`available_memory`): the
parameters the meta attempt created before it failed are counted first, and the CPU build is
stopped as soon as its parameters pass that budget, with one line instead of the kernel's OOM
killer. A model built on the CPU is kept for the next build of the same target in the process
(a check, then the analysis): a factory that cannot build on meta is never built twice in a row;
a caller that built on meta only to check a target hands its model on the same way
(:func:`keep_for_next_build`), so a plan builds its model once.

Every failure is a :class:`~autoshard.errors.TargetError` with one line saying what is wrong.
The resolved :class:`TargetSpec` is plain data, so trial workers in other processes rebuild the
same model from it.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import re
import sys
import sysconfig
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from autoshard.errors import ModelError, TargetError
from autoshard.target.values_skipped import values_skipped
from autoshard.units import format_bytes, parse_size

# A size (e.g. 4GiB): the free memory to assume instead of the machine's (a job's own limit; the
# tests use it to try a large CPU build safely).
AVAILABLE_MEMORY_ENV = "AUTOSHARD_AVAILABLE_MEMORY"
# A CPU build may take this share of the free memory: the rest is the process's own and the
# temporaries a factory makes besides its parameters.
CPU_BUILD_SHARE = 0.8


class TargetSpec(BaseModel):
    """A target string and the keyword arguments for its callable: enough to rebuild it.

    >>> from autoshard import TargetSpec, analyze_target
    >>> profile, built = analyze_target(
    ...     TargetSpec(spec="examples/gpt.py:build", kwargs={"size": "tiny"}))
    >>> profile.built_on, profile.total_params, profile.block_classes
    ('meta', 1872640, ('gpt.Block',))
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec: str = Field(..., description="'path/to/file.py:callable' or 'package.module:callable'.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments of the callable.")

    def __str__(self) -> str:
        args = " ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.spec} {args}".strip()


@dataclass
class BuiltModel:
    """A model built from a target, with what came with it."""

    model: nn.Module
    batch: Any | None = None
    built_on: str = "meta"
    warnings: list[str] = field(default_factory=list)
    # The user's data (a DataModule, DataLoader or iterable beside the model, or a
    # LightningModule's train_dataloader()): ``batch`` is its first batch, real on the CPU.
    data: Any | None = None


class BuildFallbackWarning(UserWarning):
    """The model could not be built on the meta device and was built on the CPU instead."""


class FactoryWaitWarning(UserWarning):
    """The model's factory has not returned after :data:`FACTORY_WAIT_S` seconds: one line
    saying what autoshard waits for (the factory runs in this process, where ``--trial-timeout``
    does not apply: it bounds trials in the workers)."""


# Seconds of a factory's silence before a line says what autoshard waits for (a 70B model builds
# on the meta device in 0.4 s; a factory that waits on a lock, a download or input takes longer).
FACTORY_WAIT_S = 10.0


@contextlib.contextmanager
def _said_if_slow(label: str) -> Iterator[None]:
    """Run the body; if it takes longer than :data:`FACTORY_WAIT_S`, warn once, from another
    thread, naming the factory and the line where this thread is."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield  # a trial worker: its trial timeout bounds the build
        return
    caller = threading.get_ident()
    after = FACTORY_WAIT_S

    def say() -> None:
        frame = sys._current_frames().get(caller)
        where = (
            f" (now at {Path(frame.f_code.co_filename).name}:{frame.f_lineno} in "
            f"{frame.f_code.co_name})"
            if frame is not None
            else ""
        )
        warnings.warn(
            f"{label}() has not returned after {after:g} s{where}: autoshard waits for it (the "
            "factory runs in this process to analyse the model; --trial-timeout bounds trials "
            "only); Ctrl-C stops it",
            FactoryWaitWarning,
            stacklevel=1,
        )

    timer = threading.Timer(after, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def parse_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """Parse ``["n_layer=48", "name=gpt"]`` into ``{"n_layer": 48, "name": "gpt"}``.

    Values are Python literals when they parse as one (numbers, booleans, tuples, None) and
    strings otherwise, so ``--arg dtype=bfloat16`` needs no quotes.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise TargetError(f"--arg {item!r}: write it as key=value, e.g. --arg n_layer=48")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def load_callable(spec: str) -> Callable[..., Any]:
    """Import the callable named by ``spec``; raise :class:`TargetError` with one line if not."""
    path_part, sep, attr = spec.rpartition(":")
    if not sep or not path_part or not attr:
        raise TargetError(
            f"target {spec!r} must be path/to/file.py:callable or package.module:callable"
        )
    module = _import_file(path_part) if _looks_like_path(path_part) else _import_module(path_part)
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        hint = f" (callables there: {', '.join(public[:8])})" if public else ""
        raise TargetError(f"{path_part} has no callable named {attr!r}{hint}")
    obj = getattr(module, attr)
    if not callable(obj):
        raise TargetError(f"{spec} is a {type(obj).__name__}, not a callable that builds a model")
    return obj


def _looks_like_path(text: str) -> bool:
    return text.endswith(".py") or "/" in text or "\\" in text


def _import_file(path_text: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise TargetError(f"model file not found: {path_text}")
    path = path.resolve()
    # The file's stem is its module name and its folder goes on sys.path, so the class paths
    # autoshard emits (``gpt.Block``) import in the user's training script run from there, and
    # the file's sibling imports work as when the user runs it.
    name = path.stem
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None) == str(path):
        return existing
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise TargetError(f"cannot import {path_text} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        raise TargetError(f"syntax error in {path_text} line {exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        sys.modules.pop(name, None)
        raise TargetError(f"importing {path_text} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise TargetError(
                f"module {name!r} not found; give a file path (model.py:build) or an importable "
                "module"
            ) from exc
        raise TargetError(f"importing {name} failed: ModuleNotFoundError: {exc}") from exc
    except SyntaxError as exc:
        raise TargetError(f"syntax error in {exc.filename} line {exc.lineno}: {exc.msg}") from exc
    except Exception as exc:
        raise TargetError(f"importing {name} failed: {type(exc).__name__}: {exc}") from exc


def build_model(
    factory: Callable[..., Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device = "meta",
    name: str | None = None,
) -> BuiltModel:
    """Call ``factory(**kwargs)`` under ``device`` and check that it gave a model.

    On the meta device no memory is used; when the factory cannot run there (it reads tensor
    values, say) it is built again on the CPU with a :class:`BuildFallbackWarning`.
    """
    kwargs = dict(kwargs or {})
    label: str = name or str(getattr(factory, "__name__", repr(factory)))
    built_on = str(torch.device(device).type)
    notes: list[str] = []
    meta = _ParameterCount()
    try:
        with meta:
            result = _call_under(factory, kwargs, device, label)
    except _FactoryRaised as first:
        if built_on != "meta":
            raise TargetError(first.message) from first.__cause__
        free = available_memory()
        budget = int(free * CPU_BUILD_SHARE) if free is not None else None
        if budget is not None and meta.bytes > budget:
            raise TargetError(_too_large(label, first.short, meta.bytes, free, "~")) from None
        note = (
            f"{label} could not be built on the meta device ({first.short}); building it on "
            "the CPU instead, which takes real memory. Make the factory meta-safe (no reads of "
            "tensor values while building) to analyse large models without memory."
        )
        # Said before a build that may be long and large (the meta attempt had built layers),
        # after one that failed at once (a factory that raises anyway: its error alone is said).
        early = meta.bytes > 0
        if early:
            warnings.warn(note, BuildFallbackWarning, stacklevel=2)
        try:
            with _ParameterCount(limit=budget):
                result = _call_under(factory, kwargs, "cpu", label)
        except _FactoryRaised as second:
            raise TargetError(second.message) from second.__cause__
        except _OverBudget as over:
            raise TargetError(
                _too_large(label, first.short, over.bytes, free, "more than ")
            ) from None
        if not early:
            warnings.warn(note, BuildFallbackWarning, stacklevel=2)
        notes.append(note)
        built_on = "cpu"
    model, batch = _split_result(result, label)
    _configure_model_hook(model, built_on, label)
    if next(model.parameters(), None) is None:
        raise ModelError(
            f"{label} returned a {type(model).__name__} with no parameters; there is nothing "
            "to shard (does it create its layers in a hook that was not called?)"
        )
    from autoshard.target.data import data_source

    data = data_source(model, batch, label)  # made here, in every process: never pickled
    if data is not None:
        batch = data.first
    if batch is None:
        batch = getattr(model, "example_input_array", None)
    return BuiltModel(model=model, batch=batch, built_on=built_on, warnings=notes, data=data)


def available_memory() -> int | None:
    """Bytes this process may still allocate: ``AUTOSHARD_AVAILABLE_MEMORY`` when set, else the
    least of /proc/meminfo's MemAvailable and what its cgroups' memory.max leave (Linux); None
    where unknown."""
    given = os.environ.get(AVAILABLE_MEMORY_ENV)
    if given:
        return parse_size(given, flag=AVAILABLE_MEMORY_ENV)
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):  # cgroup v2: every level's limit counts
                group = Path("/sys/fs/cgroup") / line[3:].strip().lstrip("/")
                for level in [group, *group.parents]:
                    limit = _read_int(level / "memory.max")
                    used = _read_int(level / "memory.current")
                    if limit is not None and used is not None:
                        found.append(max(0, limit - used))
                    if level == Path("/sys/fs/cgroup"):
                        break
    return min(found) if found else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _too_large(label: str, why: str, size: int, free: int | None, about: str) -> str:
    return (
        f"building {label} on the CPU needs {about}{format_bytes(size)} of parameters; this "
        f"machine has {format_bytes(free or 0)} free: make the factory meta-safe (it could not "
        f"be built on the meta device: {why}; read no tensor values while building, e.g. "
        "initialise weights in reset_parameters), or run where more memory is free "
        f"({AVAILABLE_MEMORY_ENV} sets what autoshard assumes)"
    )


class _OverBudget(BaseException):
    """A CPU build passed the free memory. BaseException: a factory's own ``except Exception``
    must not swallow it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.bytes = size


class _ParameterCount:
    """Counts the bytes of the parameters and buffers that modules register while it is
    entered (torch's global registration hooks); raises :class:`_OverBudget` past ``limit``."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.bytes = 0
        self._seen: set[int] = set()
        self._handles: list[Any] = []

    def _count(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or id(tensor) in self._seen:
            return
        self._seen.add(id(tensor))
        self.bytes += tensor.numel() * tensor.element_size()
        if self.limit is not None and self.bytes > self.limit:
            raise _OverBudget(self.bytes)

    def __enter__(self) -> _ParameterCount:
        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_parameter_registration_hook(self._count),
            hooks.register_module_buffer_registration_hook(self._count),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def exit_message(exc: SystemExit, said: str = "") -> str:
    """One line for a ``SystemExit`` raised by a model's code (``sys.exit``, argparse): its
    code, the frame that called it (the first outside the standard library, from the end),
    and the last line it printed (``said``: argparse's message).

    >>> try:
    ...     sys.exit(3)
    ... except SystemExit as exc:
    ...     print(exit_message(exc).split(", called")[0])
    SystemExit: exit code 3
    """
    code = exc.code
    text = f"SystemExit: {code}" if isinstance(code, str) else f"SystemExit: exit code {code or 0}"
    stdlib = sysconfig.get_paths()["stdlib"]
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not (f.filename.startswith(stdlib) and "-packages" not in f.filename)
    ]
    if frames:
        text += (
            f", called at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}"
        )
    last = [line.strip() for line in said.splitlines() if line.strip()]
    if last and not isinstance(code, str):
        text += f" ({last[-1][:300]})"
    return text


class _FactoryRaised(Exception):
    def __init__(self, label: str, exc: BaseException) -> None:
        self.short = (
            exit_message(exc)
            if isinstance(exc, SystemExit)
            else f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        )
        self.message = f"{label} raised {self.short}"
        super().__init__(self.message)


def _call_under(
    factory: Callable[..., Any], kwargs: dict[str, Any], device: str | torch.device, label: str
) -> Any:
    # No values on meta: the initialisers are skipped (values_skipped's note: a 70B build 4x faster)
    skipped = values_skipped() if torch.device(device).type == "meta" else contextlib.nullcontext()
    try:
        with torch.device(device), skipped, _said_if_slow(label):
            return factory(**kwargs)
    except TypeError as exc:
        # A wrong keyword is the user's typo, not a meta-device problem: say it at once.
        text = str(exc)
        if "unexpected keyword argument" in text or "missing" in text:
            # Name the flag that fixes it: the factory's arguments come from --arg key=value.
            names = re.findall(r"'(\w+)'", text.partition("argument")[2])
            fix = (
                " ".join(f"--arg {name}=..." for name in names)
                if "missing" in text and names
                else "--arg key=value with a name the factory takes"
            )
            raise TargetError(f"{label}: {text}; give {fix}") from exc
        raise _FactoryRaised(label, exc) from exc
    except (Exception, SystemExit) as exc:  # sys.exit or argparse in a factory: its error too
        raise _FactoryRaised(label, exc) from exc


def _split_result(result: Any, label: str) -> tuple[nn.Module, Any | None]:
    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        return result[0], result[1]
    raise TargetError(
        f"{label} returned {type(result).__name__}; it must return a torch.nn.Module, or a "
        "(module, example_batch) or (module, DataModule/DataLoader/iterable of batches) tuple"
    )


def _configure_model_hook(model: nn.Module, device: str, label: str) -> None:
    """Run a LightningModule's ``configure_model`` hook, where it creates the layers."""
    hook = getattr(model, "configure_model", None)
    if hook is None or not callable(hook):
        return
    try:
        with torch.device(device):
            hook()
    except Exception as exc:
        raise TargetError(
            f"{label}.configure_model() raised {type(exc).__name__}: {exc}".splitlines()[0]
        ) from exc


def resolve(spec: str | TargetSpec, kwargs: Mapping[str, Any] | None = None) -> TargetSpec:
    """Check that ``spec`` names an importable callable and return it as a :class:`TargetSpec`."""
    target = (
        spec if isinstance(spec, TargetSpec) else TargetSpec(spec=spec, kwargs=dict(kwargs or {}))
    )
    load_callable(target.spec)
    return target


# The last model built and not yet used, for the next build of its target (see the module
# docstring): (target, model). One entry, taken by the build that uses it.
_KEPT: list[tuple[TargetSpec, BuiltModel]] = []


def build_target(target: TargetSpec, *, device: str | torch.device = "meta") -> BuiltModel:
    """Import and build the model of ``target`` under ``device``."""
    wanted = torch.device(device).type
    if _KEPT and _KEPT[0][0] == target and wanted in _SERVES.get(_KEPT[0][1].built_on, ()):
        built = _KEPT.pop()[1]
        for note in built.warnings:  # said for this build too (a command shows a line once)
            warnings.warn(note, BuildFallbackWarning, stacklevel=2)
        return built
    factory = load_callable(target.spec)
    built = build_model(factory, target.kwargs, device=device, name=target.spec.rpartition(":")[2])
    _KEPT.clear()
    if built.built_on == "cpu" and wanted == "meta":
        _KEPT.append((target, built))
    return built


# A kept model built on (key) serves a build wanted on: a CPU model also stands in for meta.
_SERVES = {"cpu": ("meta", "cpu"), "meta": ("meta",)}


def forget_kept_build() -> None:
    """Drop the model kept for the next build, if any. A trial worker calls it when a trial
    ends: a model kept then is that trial's (a factory that fell back to the CPU and was too
    large for the worker to build twice), sharded and trained: the next trial must build its
    own, and the kept one's memory is that trial's leftover."""
    _KEPT.clear()


def keep_for_next_build(target: TargetSpec, built: BuiltModel) -> None:
    """Hand ``built`` (``target``'s model, not used by the caller) to the next
    :func:`build_target` of ``target``: a check that builds a model on meta does not cost the
    plan a second build (0.4 s for a 70B model, 2 s before its initialisers were skipped)."""
    _KEPT[:] = [(target, built)]
