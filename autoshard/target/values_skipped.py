"""Building a model whose tensors hold no values (meta or fake): the initialisers are skipped.

A model is built on the meta device for analysis and on fake tensors for the simulation; neither
holds values, so writing initial values computes nothing. It is not free: the meta kernel of
``normal_`` is a Python decomposition (about 0.8 ms a call, torch 2.13) whose first call imports
``torch._dynamo`` (about 1.3 s), and a 70B model's build calls it about 1,000 times.
Under :func:`values_skipped` an in-place operation that writes only values (``normal_``,
``uniform_``, ``zero_``, ``copy_``, ``clamp_``...) on a tensor with no values returns that tensor
as it is; shapes, dtypes and strides are unchanged, as they would be by the operation. Tensors
with values (a buffer the factory makes on the CPU on purpose) are written as usual.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# In-place operations that change a tensor's size, storage or strides, not only its values.
_RESHAPING = ("resize", "set_", "as_strided", "swap")


@functools.cache
def writes_values_only(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` writes into its first argument (``Tensor(a!) self``) and returns it, and
    changes nothing else about it (view operations like ``t_`` and ``resize_`` do)."""
    schema = func._schema
    name = schema.name.rpartition("::")[2]
    if not schema.arguments or len(schema.returns) != 1 or torch.Tag.inplace_view in func.tags:
        return False
    first, out = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return (
        name.endswith("_")
        and not any(word in name for word in _RESHAPING)
        and first is not None
        and first.is_write
        and out is not None
        and out.before_set == first.before_set
    )


def _holds_no_values(tensor: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # loaded with torch

    return isinstance(tensor, torch.Tensor) and (tensor.is_meta or isinstance(tensor, FakeTensor))


class _ValuesSkipped(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never compiled; torch's default wraps the mode in an import of dynamo

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if args and _holds_no_values(args[0]) and writes_values_only(func):
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def values_skipped() -> Iterator[None]:
    """Skip the in-place writes of values into meta and fake tensors (see the module's text).

    >>> import torch
    >>> with torch.device("meta"), values_skipped():
    ...     layer = torch.nn.Linear(4096, 4096)  # kaiming_uniform_ and uniform_, not run
    >>> layer.weight.shape, layer.weight.is_meta
    (torch.Size([4096, 4096]), True)
    """
    with _ValuesSkipped():
        yield
