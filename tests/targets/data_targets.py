"""Targets that bring their own data: a DataLoader of padded token batches with a label mask, an
image LightningDataModule, and a LightningModule with its own ``train_dataloader()``.

Every dataset is made from its own seeded generator, so that the model's initialisation (seed 0
in a trial) is the same in any process that builds the target, and the loader's batches are
values no synthesised batch has: a test can recompute a trial's first loss.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler

VOCAB = 64
PAD = 0
IGNORE = -100


class Blocks(nn.Module):
    """A tiny token model: embedding, two repeated blocks, a head."""

    def __init__(self, width: int = 32, vocab: int = VOCAB, context: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 2, 2 * width, batch_first=True, dropout=0.0)
            for _ in range(2)
        )
        self.head = nn.Linear(width, vocab)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Any = None
    ) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, src_key_padding_mask=attention_mask == 0)
        return self.head(x)


class Sentences(Dataset[torch.Tensor]):
    """Token sequences of 5 to 24 tokens (never 0, the padding id), made when read: the factory
    runs under the meta device, where a tensor made while building would hold no data."""

    def __init__(self, count: int = 16, seed: int = 1234) -> None:
        self.count, self.seed = count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + index)
        length = int(torch.randint(5, 25, (1,), generator=generator))
        return torch.randint(1, VOCAB, (length,), generator=generator)


def pad_collate(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Padded to the longest sample; padding masked out of attention and of the loss."""
    longest = max(len(t) for t in items)
    ids = torch.full((len(items), longest), PAD, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, t in enumerate(items):
        ids[row, : len(t)] = t
        mask[row, : len(t)] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def autoshard_loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy over the real tokens only (labels of -100 are padding)."""
    logits = output[:, :-1].reshape(-1, output.shape[-1]).float()
    return F.cross_entropy(logits, batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE)


def token_loader(batch_size: int = 2, fixed: bool = False) -> tuple[nn.Module, DataLoader[Any]]:
    """The model and a DataLoader of padded dicts; ``fixed``: batches made by a batch_sampler
    of its own, whose size cannot be changed."""
    model = Blocks()
    if fixed:
        sampler = BatchSampler(SequentialSampler(range(16)), batch_size=3, drop_last=False)
        return model, DataLoader(Sentences(), batch_sampler=sampler, collate_fn=pad_collate)
    return model, DataLoader(Sentences(), batch_size=batch_size, collate_fn=pad_collate)


def token_generator() -> tuple[nn.Module, Any]:
    """The model and a generator of made batches (3 samples each)."""
    data = Sentences()
    return Blocks(), (pad_collate([data[j] for j in range(i, i + 3)]) for i in range(0, 15, 3))


# --- images, the Lightning way ---------------------------------------------------------------


class Images(L.LightningDataModule):
    """A DataModule whose dataset exists only after ``setup("fit")``: dicts of ``image`` and
    ``label``, the keys :class:`Classifier`'s ``training_step`` reads."""

    def __init__(self, size: int = 16, batch_size: int = 4) -> None:
        super().__init__()
        self.size, self.batch_size = size, batch_size
        self.dataset: list[dict[str, torch.Tensor]] | None = None

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(99)
        images = torch.rand(12, 3, self.size, self.size, generator=generator)
        labels = torch.randint(0, 10, (12,), generator=generator)
        self.dataset = [{"image": i, "label": y} for i, y in zip(images, labels, strict=True)]

    def train_dataloader(self) -> DataLoader[Any]:
        assert self.dataset is not None, "setup('fit') was not called"
        return DataLoader(self.dataset, batch_size=self.batch_size)


class Classifier(L.LightningModule):
    """Convolutional blocks and a head; ``training_step`` works on its loader's batches only."""

    def __init__(self, width: int = 16, loader: bool = False, size: int = 16) -> None:
        super().__init__()
        self.size, self.loader = size, loader
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*[ConvBlock(width) for _ in range(3)])
        self.head = nn.Linear(width, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(image))
        return self.head(x.mean(dim=(2, 3)))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int = 0) -> torch.Tensor:
        return F.cross_entropy(self(batch["image"]), batch["label"])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters())


class ConvBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.GroupNorm(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.norm(self.conv(x)))


class OwnLoader(Classifier):
    """A Classifier that has its own ``train_dataloader()`` (its data made in ``setup``)."""

    def setup(self, stage: str) -> None:
        self.images = Images(self.size, batch_size=2)
        self.images.setup(stage)

    def train_dataloader(self) -> DataLoader[Any]:
        return self.images.train_dataloader()


def image_datamodule(size: int = 16, batch_size: int = 4) -> tuple[Classifier, Images]:
    return Classifier(size=size), Images(size, batch_size)


def own_loader(size: int = 16) -> OwnLoader:
    return OwnLoader(size=size)


def eager_tensors() -> tuple[nn.Module, DataLoader[Any]]:
    """A dataset of tensors made while building: under the meta device they hold no data."""
    from torch.utils.data import TensorDataset

    return Blocks(), DataLoader(TensorDataset(torch.randint(1, VOCAB, (8, 12))), batch_size=2)
