"""One training step's batch and loss (autoshard/target/step.py), piece by piece: a target's batch
cut or repeated to the micro-batch, its samples and tokens, the vocabulary, the batch
synthesised, resized, moved and fed, and the loss in its documented order."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_a_targets_batch_is_cut_or_repeated_to_the_micro_batch() -> None:
    """Trials and the simulation run the candidate's micro-batch, not the target's own batch
    size (the estimators count per sample): every tensor led by the samples is resized, the
    rest kept."""
    from autoshard.target.step import batch_samples, make_batch

    ids = torch.arange(8).reshape(2, 4)
    pair = (ids, ids + 100)
    mask = torch.ones(3, 3)  # not led by the 2 samples: kept
    for mbs in (1, 2, 3, 5):
        inputs, targets = make_batch(nn.Linear(1, 1), pair, micro_batch_size=mbs, seq_len=None,
                                     device=torch.device("cpu"))  # fmt: skip
        assert inputs.shape == targets.shape == (mbs, 4)
        assert torch.equal(targets - inputs, torch.full((mbs, 4), 100))  # rows stay paired
        assert inputs[:, 0].tolist() == [0, 4, 0, 4, 0][:mbs]
        batch = make_batch(nn.Linear(1, 1), {"x": ids, "mask": mask}, micro_batch_size=mbs,
                           seq_len=None, device=torch.device("cpu"))  # fmt: skip
        assert batch_samples(batch) == mbs and batch["mask"] is mask


def test_a_batchs_tokens_are_every_samples_tokens() -> None:
    # tokens per batch, not per sample: per sample, a trial's tokens/s falls as its
    # micro-batch grows
    import torch

    from autoshard.target.step import batch_samples, batch_tokens

    ids = torch.ones(4, 128, dtype=torch.long)
    assert batch_tokens(ids) == 512 and batch_samples(ids) == 4
    assert batch_tokens({"input_ids": ids, "attention_mask": ids}) == 512
    assert batch_tokens((ids, ids)) == 512 and batch_samples((ids, ids)) == 4
    assert batch_samples({"pixel_values": torch.randn(3, 3, 8, 8)}) == 3
    # not token ids: no tokens
    assert batch_tokens(torch.randn(4, 128)) is None
    assert batch_tokens(torch.ones(4, dtype=torch.long)) is None
    assert batch_tokens({"pixel_values": torch.randn(3, 3, 8, 8)}) is None


def test_the_vocabulary_is_an_attribute_or_the_largest_embeddings_rows() -> None:
    import torch
    from torch import nn

    from autoshard.target.step import find_vocab_size

    class Holder(nn.Module):
        def __init__(self, **attrs: object) -> None:
            super().__init__()
            self.small = nn.Embedding(50, 4)  # 200 weights
            self.big = nn.Embedding(30, 100)  # 3,000 weights: the token embedding
            for key, value in attrs.items():
                setattr(self, key, value)

    assert find_vocab_size(Holder()) == 30
    assert find_vocab_size(Holder(vocab_size=1000)) == 1000
    assert find_vocab_size(Holder(vocab_size=0)) == 30  # not a size
    config = type("Config", (), {"vocab_size": 777})()
    assert find_vocab_size(Holder(config=config)) == 777
    assert find_vocab_size(nn.Linear(2, 2)) is None
    assert torch.is_tensor(Holder().big.weight)


def test_a_synthesised_token_batch_and_a_targets_batch_resized() -> None:
    import torch
    from torch import nn

    from autoshard.errors import ConfigError
    from autoshard.target.step import make_batch

    model = nn.Embedding(100, 4)
    cpu = torch.device("cpu")
    ids = make_batch(model, None, micro_batch_size=3, seq_len=16, device=cpu)
    assert ids.shape == (3, 16) and ids.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < 100 and int(ids.max()) > 50
    again = make_batch(model, None, micro_batch_size=3, seq_len=16, device=cpu)
    other = make_batch(model, None, micro_batch_size=3, seq_len=16, device=cpu, seed=1)
    assert torch.equal(ids, again) and not torch.equal(ids, other)  # seeded
    built = (torch.ones(2, 5), torch.zeros(2, dtype=torch.long))
    x, y = make_batch(model, built, micro_batch_size=4, seq_len=None, device=cpu)
    assert x.shape == (4, 5) and y.shape == (4,)
    for seq_len, nothing in ((None, model), (16, nn.Linear(2, 2))):
        with pytest.raises(ConfigError, match=r"^no example batch: .*give --seq-len"):
            make_batch(nothing, None, micro_batch_size=1, seq_len=seq_len, device=cpu)


def test_resizing_and_moving_a_batch_keep_its_structure() -> None:
    import torch

    from autoshard.target.step import move_to, resize_batch

    rows = torch.arange(4).reshape(2, 2)
    batch = {"x": rows, "pair": (rows, [rows]), "scale": torch.tensor(3.0), "n": 7,
             "other": torch.zeros(5, 2)}  # fmt: skip
    assert resize_batch(batch, 2) is batch
    five = resize_batch(batch, 5)
    assert five["x"].tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    assert isinstance(five["pair"], tuple) and isinstance(five["pair"][1], list)
    assert five["pair"][1][0].shape == (5, 2)
    assert five["scale"] is batch["scale"] and five["n"] == 7
    assert five["other"] is batch["other"]  # not the batch's leading dimension
    assert resize_batch(batch, 1)["x"].tolist() == [[0, 1]]
    assert resize_batch(rows, 3).tolist() == [[0, 1], [2, 3], [0, 1]]
    moved = move_to(batch, torch.device("meta"))
    assert moved["x"].is_meta and moved["pair"][1][0].is_meta and moved["n"] == 7
    assert isinstance(moved["pair"], tuple) and isinstance(moved["pair"][1], list)
    assert move_to("text", torch.device("meta")) == "text"


def test_a_batch_is_fed_as_keywords_arguments_or_one_value() -> None:
    import torch
    from torch import nn

    from autoshard.target.step import forward, with_labels

    class Echo(nn.Module):
        def forward(self, a: object = None, b: object = None, labels: object = None) -> object:
            return (a, b, labels)

    one = torch.ones(1)
    assert forward(Echo(), {"b": one}) == (None, one, None)
    assert forward(Echo(), (one, 2)) == (one, 2, None)
    assert forward(Echo(), [one, 2]) == (one, 2, None)
    assert forward(Echo(), one) == (one, None, None)
    # Hugging Face style: labels are the input ids, where forward takes them
    ids = torch.ones(2, 3, dtype=torch.long)
    assert with_labels(Echo(), {"input_ids": ids})["labels"] is ids
    assert "labels" not in with_labels(nn.Identity(), {"input_ids": ids})
    given = {"input_ids": ids, "labels": ids + 1}
    assert with_labels(Echo(), given) is given
    assert with_labels(Echo(), ids) is ids and with_labels(Echo(), {"a": ids}) == {"a": ids}


def test_the_loss_follows_its_documented_order() -> None:
    import torch
    import torch.nn.functional as F

    from autoshard.errors import ConfigError
    from autoshard.target.step import compute_loss, find_loss_fn

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    # the user's function first
    assert compute_loss(logits, ids, lambda out, batch: torch.tensor(42.0)).item() == 42.0
    # an output's .loss, a dict's "loss"
    hf = type("Out", (), {"loss": torch.tensor(3.0), "logits": logits})()
    assert compute_loss(hf, ids).item() == 3.0
    assert compute_loss({"loss": torch.tensor(4.0)}, ids).item() == 4.0
    # a scalar output is the loss
    assert compute_loss(torch.tensor(5.0), ids).item() == 5.0
    # next-token cross-entropy for [B, T, V] logits of a token batch (tuple output: the first)
    next_token = F.cross_entropy(logits[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1))
    assert torch.allclose(compute_loss((logits, None), ids), next_token)
    assert torch.allclose(compute_loss(logits, {"input_ids": ids}), next_token)
    assert torch.allclose(compute_loss([logits], ids), next_token)
    # [N, C] scores against the batch's integer targets (after the inputs)
    scores, y = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    x = torch.randn(4, 8)
    assert torch.allclose(compute_loss(scores, (x, y)), F.cross_entropy(scores, y))
    assert torch.allclose(compute_loss(scores, {"x": x, "y": y}), F.cross_entropy(scores, y))
    # otherwise the mean of the output
    assert torch.allclose(compute_loss(scores, x), scores.mean())
    assert torch.allclose(compute_loss(scores, (y, x)), scores.mean())  # targets come after
    assert torch.allclose(compute_loss(logits, ids[:, :3]), logits.mean())  # shapes differ
    with pytest.raises(ConfigError, match=r"^cannot compute a loss from a str output"):
        compute_loss("text", ids)
    # the user's function is found in the target's module, when callable
    module = type("M", (), {"autoshard_loss": staticmethod(lambda o, b: o)})
    assert find_loss_fn(module) is module.autoshard_loss
    assert find_loss_fn(type("M", (), {"autoshard_loss": 3})) is None


def test_the_step_helpers_at_their_edges() -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from autoshard.errors import ConfigError
    from autoshard.target.step import (
        batch_samples,
        batch_tokens,
        compute_loss,
        find_loss_fn,
        find_vocab_size,
        make_batch,
    )

    rows = torch.arange(4).reshape(2, 2)
    assert batch_samples(torch.tensor(3.0)) == 1 and batch_samples({"n": 7}) == 1
    assert batch_samples({"n": 7, "x": rows}) == 2 and batch_samples([]) == 1
    ids = torch.ones(4, 128, dtype=torch.long)
    assert batch_tokens((ids, torch.ones(4, 7, dtype=torch.long))) == 512  # the first tensor's
    vocab_one = nn.Linear(2, 2)
    vocab_one.vocab_size = 1  # type: ignore[assignment]
    assert find_vocab_size(vocab_one) == 1
    assert find_loss_fn(type("M", (), {})) is None
    # token batches: on the device asked for, every id below the vocabulary, 0 included
    meta = make_batch(nn.Embedding(2, 4), None, micro_batch_size=4, seq_len=64,
                      device=torch.device("meta"))  # fmt: skip
    assert meta.is_meta and meta.shape == (4, 64)
    built = make_batch(nn.Embedding(2, 4), (rows,), micro_batch_size=2, seq_len=None,
                       device=torch.device("meta"))  # fmt: skip
    assert built[0].is_meta
    tokens = make_batch(nn.Embedding(2, 4), None, micro_batch_size=4, seq_len=64,
                        device=torch.device("cpu"))  # fmt: skip
    assert set(tokens.unique().tolist()) == {0, 1}
    with pytest.raises(ConfigError, match=r"or return a batch from the factory$"):
        make_batch(nn.Linear(2, 2), None, micro_batch_size=1, seq_len=8,
                   device=torch.device("cpu"))  # fmt: skip
    # the loss: the user's function gets the output and the batch
    out, batch = torch.tensor([1.0, 2.0]), torch.tensor([10.0])
    assert compute_loss(out, batch, lambda o, b: o.sum() + b.sum()).item() == 13.0
    # an output's .logits (no .loss): next-token cross-entropy
    torch.manual_seed(0)
    logits, tok = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    nt = F.cross_entropy(logits[:, :-1].reshape(-1, 11), tok[:, 1:].reshape(-1))
    holder = type("Out", (), {"logits": logits})()
    assert torch.allclose(compute_loss(holder, tok), nt)
    assert torch.allclose(compute_loss(logits, (tok,)), logits.mean())  # a tuple: no token ids
    with pytest.raises(
        ConfigError, match=r"define autoshard_loss\(output, batch\) in the target's module$"
    ):
        compute_loss(object(), tok)
    # [N, C] scores: targets wrap modulo the classes, found in a dict's values in any order,
    # never a float tensor
    scores, x = torch.randn(2, 5), torch.randn(2, 8)
    y = torch.tensor([3, 9])
    expected = F.cross_entropy(scores, y % 5)
    assert torch.allclose(compute_loss(scores, (x, y)), expected)
    assert torch.allclose(compute_loss(scores, {"y": y, "x": x}), expected)
    assert torch.allclose(compute_loss(scores, (x, torch.randn(2))), scores.mean())
