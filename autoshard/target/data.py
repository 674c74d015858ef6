"""The user's data: real batches from what the target returns beside the model.

A target may return ``(model, data)`` where ``data`` is a ``LightningDataModule``, a torch
``DataLoader`` or any other iterable of batches (a generator, a sampler of its own); a
LightningModule with its own ``train_dataloader()`` is its own data, as the Trainer would use it.
A DataModule (and a LightningModule that defines them) gets ``prepare_data()`` and
``setup("fit")`` first, as the Trainer calls them, in every process that builds the target:
trial workers re-import the target and make the loader again, nothing of it is pickled.

Trials, the activation profile and the FLOP count then run on its batches (the profile and the
count on fake tensors of the same shapes and dtypes). Each candidate's micro-batch is drawn
through the loader again at that batch size (the first samples of its dataset, in order, so
every rank and every run sees the same batch); a loader whose batch size is fixed (its own
``batch_sampler``, ``batch_size=None``, or an iterable that yields made batches) gives its own
size, and the plan says so once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from autoshard.errors import TargetError
from autoshard.target.step import batch_samples, resize_batch

__all__ = ["BatchSource", "data_source", "has_own_loader"]


class BatchSource:
    """Real batches from the user's loader: ``first`` as the loader gives it, ``batch(n)`` with
    ``n`` samples.

    >>> import torch
    >>> from torch.utils.data import DataLoader
    >>> source = BatchSource(DataLoader(torch.arange(10.0).reshape(5, 2), batch_size=2), "loader")
    >>> source.samples, source.fixed, source.batch(3).tolist()
    (2, False, [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])
    """

    def __init__(self, loader: Iterable[Any], origin: str) -> None:
        self.loader = loader
        self.origin = origin
        # the DataLoader that can be asked for another batch size, or None: a fixed size
        self._resizable = _resizable(loader)
        self.fixed = self._resizable is None
        source = loader if self._resizable is None else _rebatched(self._resizable, None)
        self.first = self._draw(source)
        self.samples = batch_samples(self.first)
        self._batches: dict[int, Any] = {self.samples: self.first}

    def batch(self, samples: int) -> Any:
        """A batch of ``samples`` samples: drawn through the loader at that batch size, or, where
        its size is fixed (or its dataset is smaller), its first batch cut or repeated."""
        if samples not in self._batches:
            resizable = self._resizable
            batch = self.first if resizable is None else self._draw(_rebatched(resizable, samples))
            if batch_samples(batch) != samples:
                batch = resize_batch(batch, samples)
            self._batches[samples] = batch
        return self._batches[samples]

    def describe(self) -> str:
        return self.origin + (f" (batch size fixed at {self.samples})" if self.fixed else "")

    def _draw(self, loader: Iterable[Any]) -> Any:
        """The first batch, real and on the CPU whatever the caller's device or fake mode (the
        target is built under the meta device; a simulation builds it under fake tensors)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        try:
            with unset_fake_temporarily(), torch.device("cpu"):
                batch = next(iter(loader))
        except StopIteration:
            raise TargetError(f"{self.origin} yields no batch") from None
        except TargetError:
            raise
        except Exception as exc:
            raise TargetError(
                f"{self.origin}: drawing a batch raised {type(exc).__name__}: {exc}".splitlines()[0]
            ) from exc
        if _has_meta(batch):
            raise TargetError(
                f"{self.origin} yields meta tensors: they were made while the factory ran under "
                "the meta device; make them when the data is read (the Dataset's __getitem__, "
                "the collate_fn) or in a DataModule's setup()"
            )
        return batch


def _has_meta(batch: Any) -> bool:
    if isinstance(batch, torch.Tensor):
        return batch.is_meta
    if isinstance(batch, Mapping):
        return any(_has_meta(v) for v in batch.values())
    if isinstance(batch, list | tuple):
        return any(_has_meta(v) for v in batch)
    return False


def data_source(model: Any, data: Any, label: str) -> BatchSource | None:
    """The :class:`BatchSource` of what ``label`` returned beside ``model`` (a DataModule, a
    DataLoader, an iterable of batches), or of a LightningModule's own ``train_dataloader()``;
    None when ``data`` is an example batch (or nothing) and the model has no loader."""
    if data is not None and _is_datamodule(data):
        return BatchSource(_train_loader(data, f"{label}'s {type(data).__name__}"),
                           f"{type(data).__name__}.train_dataloader()")  # fmt: skip
    if isinstance(data, DataLoader):
        return BatchSource(data, f"{label}'s DataLoader")
    if data is not None and _is_iterable_of_batches(data):
        return BatchSource(data, f"{label}'s {type(data).__name__}")
    if data is not None:
        return None
    if has_own_loader(model):
        module = _lightning_module_of(model)
        name = type(module).__name__
        return BatchSource(_train_loader(module, name), f"{name}.train_dataloader()")
    return None


def has_own_loader(model: Any) -> bool:
    """Whether ``model`` is (or wraps) a LightningModule that defines ``train_dataloader()``."""
    module = _lightning_module_of(model)
    return module is not None and _own_hook(module, "train_dataloader")


def _train_loader(owner: Any, name: str) -> Any:
    """``owner.train_dataloader()`` after ``prepare_data()`` and ``setup("fit")``, the hooks the
    Trainer calls first (those ``owner`` defines), on the CPU and outside any fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    hooks = [("prepare_data", ()), ("setup", ("fit",)), ("train_dataloader", ())]
    loader: Any = None
    with unset_fake_temporarily(), torch.device("cpu"):
        for hook, args in hooks:
            if hook != "train_dataloader" and not _own_hook(owner, hook):
                continue
            try:
                loader = getattr(owner, hook)(*args)
            except Exception as exc:
                raise TargetError(
                    f"{name}.{hook}({', '.join(map(repr, args))}) raised "
                    f"{type(exc).__name__}: {exc}".splitlines()[0]
                ) from exc
    if loader is None:
        raise TargetError(f"{name}.train_dataloader() returned None: return the training loader")
    return loader


def _resizable(loader: Iterable[Any]) -> DataLoader[Any] | None:
    """``loader`` if another batch size can be asked of it: only a DataLoader that batches with
    its ``batch_size`` (the default ``BatchSampler``); None where the loader makes its batches."""
    if (
        isinstance(loader, DataLoader)
        and loader.batch_size is not None
        and type(loader.batch_sampler) is BatchSampler
    ):
        return loader
    return None


def _rebatched(loader: DataLoader[Any], samples: int | None) -> DataLoader[Any]:
    """The loader's dataset and collation at ``samples`` per batch (None: its own batch size),
    in order, in this process (``num_workers=0``: one batch is not worth starting workers)."""
    return DataLoader(
        loader.dataset, batch_size=samples or loader.batch_size, shuffle=False,
        collate_fn=loader.collate_fn, num_workers=0, drop_last=False,
    )  # fmt: skip


def _is_iterable_of_batches(data: Any) -> bool:
    # A tensor, a dict or a tuple/list is one batch (the example batch), not a source of them.
    if isinstance(data, torch.Tensor | Mapping | list | tuple | str | bytes):
        return False
    return isinstance(data, Iterable)


def _lightning_class(cls: type, name: str) -> bool:
    return cls.__name__ == name and cls.__module__.startswith(("lightning", "pytorch_lightning"))


def _is_datamodule(obj: Any) -> bool:
    return any(_lightning_class(c, "LightningDataModule") for c in type(obj).__mro__)


def _lightning_module_of(model: Any) -> Any | None:
    """``model`` if it is a LightningModule, the one inside a wrapper that holds it as
    ``.module`` (:class:`~autoshard.target.adapters.LightningStep`), else None."""
    for candidate in (model, getattr(model, "module", None)):
        if candidate is not None and any(
            _lightning_class(c, "LightningModule") for c in type(candidate).__mro__
        ):
            return candidate
    return None


def _own_hook(obj: Any, name: str) -> bool:
    """Whether ``obj``'s class (not Lightning's) defines the hook ``name``."""
    for cls in type(obj).__mro__:
        if cls.__module__.startswith(("lightning", "pytorch_lightning")) or cls is object:
            return False
        if name in vars(cls):
            return True
    return False
