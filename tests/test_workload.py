"""The workload of one step (autoshard.workload): the micro-batch sizes asked for, the batch's or
the default; a seq_len that contradicts the batch refused word for word; a loader that makes its
own batches says which size is planned. Quick: no model is analysed."""

from __future__ import annotations

import pytest
import torch

from autoshard.errors import ConfigError
from autoshard.options import PlanOptions
from autoshard.target.resolve import BuiltModel
from autoshard.workload import DEFAULT_MICRO_BATCH_SIZES, micro_batch_sizes, resolve_workload


def test_micro_batch_sizes_come_from_the_options_the_batch_or_the_default() -> None:
    model = torch.nn.Linear(4, 4)
    assert micro_batch_sizes(BuiltModel(model), PlanOptions()) == DEFAULT_MICRO_BATCH_SIZES
    assert DEFAULT_MICRO_BATCH_SIZES == (1, 2, 4, 8)
    batch = torch.zeros(3, 4)
    assert micro_batch_sizes(BuiltModel(model, batch=batch), PlanOptions()) == (3,)
    asked = PlanOptions(batch_size="2,6")
    assert micro_batch_sizes(BuiltModel(model, batch=batch), asked) == (2, 6)

    class Fixed:  # a loader that makes its batches itself
        fixed, samples = True, 5

    assert micro_batch_sizes(BuiltModel(model, batch=batch, data=Fixed()), asked) == (5,)


def test_a_seq_len_that_contradicts_the_batch_is_refused_word_for_word() -> None:
    built = BuiltModel(torch.nn.Embedding(100, 4), batch=torch.zeros(2, 32, dtype=torch.long))
    with pytest.raises(ConfigError) as refused:
        resolve_workload(built, PlanOptions(seq_len=64), "the target")
    assert str(refused.value) == (
        "seq_len 64 but the batch the target returns has 32 tokens per sample, and that batch is "
        "what is measured: build it with 64 (e.g. --arg seq_len=64, or kwargs={'seq_len': 64} in "
        "code) or leave out --seq-len / seq_len="
    )


def test_a_loader_that_makes_its_batches_says_which_size_is_planned() -> None:
    class Fixed:  # a DataLoader with its own batch_sampler
        fixed, samples, origin = True, 5, "the DataLoader"

    built = BuiltModel(torch.nn.Linear(4, 4), batch=torch.zeros(5, 4), data=Fixed())
    workload, notes = resolve_workload(built, PlanOptions(batch_size="2,6"))
    assert workload.micro_batch_size == 5
    assert notes == [
        "micro-batch 5, not --batch-size 2,6: the DataLoader makes its batches itself (its own "
        "batch_sampler, batch_size=None or made batches), so trials and estimates use its size; "
        "give a DataLoader with batch_size= to compare sizes"
    ]
    _, notes = resolve_workload(built, PlanOptions(batch_size="5"))
    assert notes[0].startswith("micro-batch 5: the DataLoader makes its batches itself")
