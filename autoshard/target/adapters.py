"""Turn what a user has in hand into a :class:`~autoshard.target.resolve.TargetSpec` that trial
workers (other processes) can rebuild: the one place a model is adapted, whichever door it came
through.

- a factory (function or class) importable by module path: ``module:qualname``; one defined in
  a script run as ``__main__``: ``path/to/script.py:qualname``;
- a Hugging Face ``PreTrainedModel``: rebuilt from its config (``type(model)(config)``), so no
  weights are ever saved or downloaded;
- any other ``nn.Module`` (real or on the meta device): a meta copy that shares no data with the
  original is saved with ``torch.save`` and loaded back by :func:`load_saved_model`, which
  materialises it (``to_empty`` + ``reset_parameters``) when asked for a real device;
- a ``LightningModule``: its ``configure_model`` hook builds the layers, and its
  ``training_step(batch, 0)`` is the step: :class:`LightningStep` makes that step the forward of
  the module that is sharded, so the loss is the user's own.

The meta copy keeps tied weights tied: ``copy.deepcopy`` with a memo that maps every parameter
(and buffer) to a meta tensor of the same shape, dtype and ``requires_grad``.

What is saved goes to a folder of this user's own (:func:`_save_dir`): ``--out/targets`` or a
fresh ``tempfile.mkdtemp`` folder of this process, mode 0700, each file created anew (0600,
never through a symlink). A module object has no factory to rebuild it from, so it is pickled
whole; it is unpickled only from such a folder (:func:`_open_private`: owned by this user,
writable by no one else), never from a path another user could have written. An example batch
is read back with ``weights_only=True``: tensors and plain containers, no code.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import hashlib
import io
import os
import pickle
import shutil
import stat
import sys
import tempfile
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from autoshard.errors import ConfigError, TargetError
from autoshard.target.data import data_source, has_own_loader
from autoshard.target.resolve import (
    TargetSpec,
    _import_file,
    build_target,
    keep_for_next_build,
    load_callable,
)

__all__ = [
    "LightningStep",
    "build_hf_from_config",
    "build_lightning",
    "load_saved_model",
    "materialize",
    "meta_copy",
    "to_target",
]


# --------------------------------------------------------------------------------------------
# What the user has -> TargetSpec
# --------------------------------------------------------------------------------------------


def to_target(
    obj: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    batch: Any | None = None,
    out_dir: Path | None = None,
) -> TargetSpec:
    """A :class:`TargetSpec` for ``obj``: a target string, a ``TargetSpec``, a factory, a
    Hugging Face model, a ``LightningModule`` or any ``nn.Module``.

    Objects that must be saved (a plain module, a Hugging Face config, an example batch) go to
    ``out_dir`` (a temporary folder when None).

    >>> from torch import nn
    >>> spec = to_target(nn.Sequential(nn.Linear(4, 4)))
    >>> spec.spec
    'autoshard.target.adapters:load_saved_model'
    """
    kwargs = dict(kwargs or {})
    source = data_source(None, batch, "batch=") if batch is not None else None
    if source is not None:
        batch = source.first  # a loader in this process cannot reach the workers: its batch
    if isinstance(obj, TargetSpec):
        return _with_batch(obj, batch, out_dir)
    if isinstance(obj, str):
        return _with_batch(_factory_target(obj, kwargs, batch), batch, out_dir)
    if isinstance(obj, nn.Module):
        if kwargs:
            raise ConfigError("kwargs are for a factory; a model object takes none")
        return _module_target(obj, batch, out_dir)
    if callable(obj):
        spec = factory_spec(obj)
        if spec is None:
            raise ConfigError(
                f"{getattr(obj, '__qualname__', repr(obj))} cannot be imported by name by the "
                "trial workers (a lambda, closure or partial); define it at the top level of a "
                "module or file, or pass the model object"
            )
        return _with_batch(_factory_target(spec, kwargs, batch), batch, out_dir)
    raise ConfigError(
        f"cannot plan for a {type(obj).__name__}: give an nn.Module, a factory that returns one, "
        "or a 'path/to/file.py:build' target"
    )


def _factory_target(spec: str, kwargs: dict[str, Any], batch: Any | None) -> TargetSpec:
    """The factory's target; a LightningModule's goes through :func:`build_lightning`."""
    target = TargetSpec(spec=spec, kwargs=kwargs)
    built = build_target(target)  # on meta: a one-line TargetError here, not in a worker
    if _is_lightning_module(built.model):
        steps = callable(getattr(built.model, "training_step", None))
        return lightning_target(target, training_step=steps and (batch or built.batch) is not None)
    keep_for_next_build(target, built)  # the plan's build, made once
    return target


def factory_spec(fn: Callable[..., Any]) -> str | None:
    """``module:qualname`` of a top-level function or class, ``file.py:qualname`` for one
    defined in the script run as ``__main__``; None when workers could not import it."""
    qualname = getattr(fn, "__qualname__", None)
    module_name = getattr(fn, "__module__", None)
    if not qualname or not module_name or "<" in qualname or "." in qualname:
        return None
    module = sys.modules.get(module_name)
    if module is None or getattr(module, qualname, None) is not fn:
        return None
    if module_name == "__main__":
        path = getattr(module, "__file__", None)
        return f"{Path(path).resolve()}:{qualname}" if path else None
    path = getattr(module, "__file__", None)
    # A top-level module (one file, no package) may sit in a folder only this process has on
    # sys.path (a file loaded by path, a notebook's folder): its path works in any process.
    if path and module_name == Path(path).stem:
        return f"{Path(path).resolve()}:{qualname}"
    return f"{module_name}:{qualname}"


def _module_target(model: nn.Module, batch: Any | None, out_dir: Path | None) -> TargetSpec:
    if _is_hf_model(model):
        return _hf_target(model, batch, out_dir)
    if _is_lightning_module(model):
        model = meta_copy(model)
        hook = getattr(model, "configure_model", None)
        if callable(hook):
            with torch.device("meta"):
                hook()
        if batch is None and not has_own_loader(model):
            batch = getattr(model, "example_input_array", None)
        elif callable(getattr(model, "training_step", None)):
            model = LightningStep(model)  # its own train_dataloader() is drawn in the workers
    path = _save_dir(out_dir) / f"model-{_digest_module(model)}.pt"
    files = _class_files(model)
    payload: dict[str, Any] = {"model": meta_copy(model), "batch": _saveable_batch(batch)}
    _write_private(path, lambda fh: torch.save(payload, fh))
    kw: dict[str, Any] = {"path": str(path)}
    if files:
        kw["files"] = files
    return TargetSpec(spec="autoshard.target.adapters:load_saved_model", kwargs=kw)


def _with_batch(spec: TargetSpec, batch: Any | None, out_dir: Path | None) -> TargetSpec:
    if batch is None:
        return spec
    path = _save_dir(out_dir) / f"batch-{_digest(repr(spec))}.pt"
    saveable = _saveable_batch(batch)
    _write_private(path, lambda fh: torch.save(saveable, fh))
    return TargetSpec(
        spec="autoshard.target.adapters:with_saved_batch",
        kwargs={"target": spec.spec, "target_kwargs": spec.kwargs, "batch_path": str(path)},
    )


def with_saved_batch(target: str, target_kwargs: dict[str, Any], batch_path: str) -> Any:
    """Worker side of a target given with an in-memory batch: the target's model, that batch."""
    result = load_callable(target)(**target_kwargs)
    model = result[0] if isinstance(result, tuple) else result
    return model, _load_batch(batch_path)


def _saveable_batch(batch: Any) -> Any:
    """The batch on the CPU; a meta batch (shapes only) becomes zeros of the same shapes. A
    mapping (a tokenizer's ``BatchEncoding``) becomes a dict: what ``weights_only`` reads."""
    if isinstance(batch, torch.Tensor):
        return torch.zeros(batch.shape, dtype=batch.dtype) if batch.is_meta else batch.cpu()
    if isinstance(batch, Mapping):
        return {k: _saveable_batch(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_saveable_batch(v) for v in batch)
    return batch


# This process's private folder for saved targets when no output folder is given (made once,
# removed when the process ends: the trial workers that read it are the process's children).
_PROCESS_FOLDER: list[Path] = []


def _save_dir(out_dir: Path | None) -> Path:
    """A folder of this user's own for what must be saved: ``out_dir/targets``, or this
    process's ``tempfile.mkdtemp`` folder (never a predictable shared path: another user could
    create it first, or plant symlinks in it)."""
    if out_dir:
        folder = Path(out_dir) / "targets"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            _check_private(folder, st)  # a symlink, another user's: one line
        os.chmod(folder, 0o700)  # this user's own: private from now on
        return folder
    if not _PROCESS_FOLDER:
        made = Path(tempfile.mkdtemp(prefix="autoshard-targets-"))  # 0700, a random name
        atexit.register(shutil.rmtree, made, ignore_errors=True)
        _PROCESS_FOLDER.append(made)
    return _PROCESS_FOLDER[0]


def _check_private(path: Path, st: os.stat_result) -> None:
    """``st`` (of ``path``, not followed) must be a real folder or file of this user that no
    one else may write; else TargetError."""
    kind_ok = stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)
    if not kind_ok or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise TargetError(
            f"{path} is not a private folder or file of this user (a symlink, another user's, "
            "or writable by others): autoshard saves and reads targets only in its own folders; "
            "give an output folder of your own"
        )


def _write_private(path: Path, save: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` through a new file of mode 0600 (never an existing one, never through
    a symlink), renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            save(fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _open_private(path: str) -> bytes:
    """The bytes of ``path``, which must be a file of this user in a folder of this user
    that no one else may write (see the module docstring); else TargetError."""
    file = Path(path)
    try:
        folder = os.open(file.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _check_private(file.parent, os.fstat(folder))
            fd = os.open(file.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
        finally:
            os.close(folder)
        with os.fdopen(fd, "rb") as fh:
            _check_private(file, os.fstat(fh.fileno()))
            return fh.read()
    except OSError as exc:
        raise TargetError(f"saved model {path} cannot be read: {exc}") from exc


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _digest_module(model: nn.Module) -> str:
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    return _digest(f"{type(model).__module__}.{type(model).__qualname__}{shapes}{model!r}")


def _class_files(model: nn.Module) -> dict[str, str]:
    """Files that define classes of the model and that a worker cannot import by name: the
    script run as ``__main__``, and top-level modules loaded from a file path (their folder is
    on this process's ``sys.path`` only). Module name -> file path."""
    out: dict[str, str] = {}
    for m in model.modules():
        name = type(m).__module__
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if name == "__main__" and not path:
            raise ConfigError(
                f"{type(m).__qualname__} is defined interactively (no file): trial workers "
                "cannot import it; define it in a .py file"
            )
        if path and (name == "__main__" or name == Path(path).stem):
            out[name] = str(Path(path).resolve())
    return out


# --------------------------------------------------------------------------------------------
# Meta copies, saving and loading
# --------------------------------------------------------------------------------------------


def meta_copy(model: nn.Module, *, keep_buffers: bool = True) -> nn.Module:
    """A copy of ``model`` whose parameters are meta tensors: no parameter data is copied.

    Tied parameters stay tied (one memo entry per tensor). Real buffers are kept (small, and
    some are computed at construction, like rotary frequencies) unless ``keep_buffers`` is False.
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
            )
    for b in model.buffers():
        if id(b) not in memo and (b.is_meta or not keep_buffers):
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        elif id(b) not in memo:
            memo[id(b)] = b.detach().cpu().clone()
    # Gradients are not copied either (deepcopy of a Parameter copies .grad).
    return copy.deepcopy(model, memo)


def _file_aware_pickle(files: Mapping[str, str] | None) -> types.ModuleType:
    """A pickle module for ``torch.load`` that imports the classes' files by path first (see
    :func:`_class_files`) and finds the classes of ``__main__`` in the user's script."""
    modules = {name: _import_file(path) for name, path in (files or {}).items()}
    if not modules:
        return pickle

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module in modules:
                return getattr(modules[module], name)
            return super().find_class(module, name)

    shim = types.ModuleType("autoshard_main_pickle")
    shim.Unpickler = Unpickler  # type: ignore[attr-defined]
    shim.load = pickle.load  # type: ignore[attr-defined]
    shim.__name__ = "pickle"
    return shim


def _load(path: str, files: Mapping[str, str] | None = None) -> Any:
    """A saved module: unpickled whole (its classes' code runs), so only from a private folder
    of this user (:func:`_open_private`), where only autoshard's own process wrote it."""
    data = _open_private(path)
    return torch.load(
        io.BytesIO(data),
        map_location="cpu",
        weights_only=False,
        pickle_module=_file_aware_pickle(files),
    )


def _load_batch(path: str) -> Any:
    """A saved example batch: tensors in plain containers, read with ``weights_only=True``."""
    try:
        data = Path(path).read_bytes()
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (OSError, pickle.UnpicklingError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetError(
            f"saved example batch {path} cannot be read as tensors ({first}); give the batch as "
            "tensors in dicts, lists or tuples"
        ) from None


def load_saved_model(path: str, files: Mapping[str, str] | None = None) -> Any:
    """Load a model saved by :func:`to_target`: on the meta device when the default device is
    meta (analysis), otherwise materialised there with fresh initial values (a trial)."""
    payload = _load(path, files)
    model: nn.Module = payload["model"]
    device = torch.get_default_device()
    if device.type != "meta":
        materialize(model, device)
    batch = payload.get("batch")
    return (model, batch) if batch is not None else model


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Give the meta parameters of ``model`` real storage on ``device`` and initialise them:
    ``reset_parameters()`` where a module has one, N(0, 0.02) for matrices and ones for vectors
    otherwise. Buffers that already hold data keep it."""
    device = torch.device(device)
    kept = {n: b for n, b in model.named_buffers() if not b.is_meta}
    ties: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    # to_empty gives every module its own new tensor: tie the shared names together again.
    for names in ties.values():
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    with torch.no_grad():
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            else:
                for p in own:
                    p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
        for name, buf in model.named_buffers():
            if name in kept:
                buf.copy_(kept[name])
            elif buf.is_floating_point():
                buf.zero_()
    return model


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


def _is_hf_model(model: nn.Module) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(model).__mro__
    )


def _hf_target(model: nn.Module, batch: Any | None, out_dir: Path | None) -> TargetSpec:
    config: Any = model.config
    text = config.to_json_string(use_diff=False)
    path = _save_dir(out_dir) / f"hf-config-{_digest(text)}.json"
    _write_private(path, lambda fh: fh.write(text.encode()))
    cls = type(model)
    spec = TargetSpec(
        spec="autoshard.target.adapters:build_hf_from_config",
        kwargs={"model_class": f"{cls.__module__}:{cls.__qualname__}", "config": str(path)},
    )
    return _with_batch(spec, batch, out_dir)


def build_hf_from_config(model_class: str, config: str | Mapping[str, Any]) -> nn.Module:
    """``model_class(config)``: a Hugging Face model rebuilt from its config, never its weights.

    ``config`` is a path to a ``config.json`` or the dict of one. Under the meta device (the
    caller's ``torch.device`` context) this costs no memory; on a real device the model's own
    ``_init_weights`` initialises it.
    """
    cls = load_callable(model_class)
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise TargetError(f"{model_class} has no config_class: not a Hugging Face model")
    if isinstance(config, str):
        cfg = config_class.from_json_file(config)
    else:
        cfg = config_class.from_dict(dict(config))
    return cls(cfg)


# --------------------------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------------------------


def _is_lightning_module(obj: Any) -> bool:
    return any(
        c.__name__ == "LightningModule" and c.__module__.startswith(("lightning", "pytorch_"))
        for c in type(obj).__mro__
    )


class LightningStep(nn.Module):
    """A LightningModule whose forward is its ``training_step(batch, 0)``.

    Trials feed a dict batch as keyword arguments and a tuple as positional arguments; this
    puts the batch back together and returns the user's loss, so the trial trains exactly what
    ``Trainer.fit`` would. The wrapped module keeps its own class (and block classes) inside.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs and not args:
            batch: Any = kwargs
        elif len(args) == 1 and not kwargs:
            batch = args[0]
        else:
            batch = args
        out = self.module.training_step(batch, 0)  # type: ignore[operator]
        if isinstance(out, Mapping):
            out = out["loss"]
        if not isinstance(out, torch.Tensor):
            raise ConfigError(
                f"{type(self.module).__name__}.training_step returned {type(out).__name__}; "
                "it must return the loss (a tensor, or a dict with 'loss')"
            )
        return out


def build_lightning(
    factory: str, kwargs: dict[str, Any] | None = None, training_step: bool = True
) -> Any:
    """Build a LightningModule from ``factory`` (a target string) and run its
    ``configure_model`` hook under the current device. With ``training_step`` (the default when
    a training batch is known: the factory's or the one given to ``recommend``), return it as a
    :class:`LightningStep`; otherwise as it is, fed its ``example_input_array``."""
    result = load_callable(factory)(**(kwargs or {}))
    module, batch = result if isinstance(result, tuple) else (result, None)
    if not isinstance(module, nn.Module):
        raise TargetError(f"{factory} returned {type(module).__name__}, not a LightningModule")
    hook = getattr(module, "configure_model", None)
    if callable(hook):
        hook()
    if not training_step or not callable(getattr(module, "training_step", None)):
        if batch is None:
            batch = getattr(module, "example_input_array", None)
        return module if batch is None else (module, batch)
    step = LightningStep(module)
    return step if batch is None else (step, batch)


def lightning_target(spec: TargetSpec, *, training_step: bool = True) -> TargetSpec:
    """The target that builds ``spec``'s LightningModule (``configure_model`` included) and,
    with ``training_step``, trains it through its own ``training_step``."""
    return TargetSpec(
        spec="autoshard.target.adapters:build_lightning",
        kwargs={"factory": spec.spec, "kwargs": dict(spec.kwargs), "training_step": training_step},
    )
