"""The seed guide's ``LanguageModel``: a LightningModule that builds its layers in
``configure_model`` and computes its loss in ``training_step``.

    autoshard estimate examples/lightning_module.py:build --gpus 8 --gpu-memory 80GiB

autoshard calls ``configure_model`` (under the meta device for analysis) and trains trials
through ``training_step(batch, 0)``, the loss the user wrote. Blocks: the demo Transformer's
``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``. Needs ``lightning``.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer


class LanguageModel(L.LightningModule):
    def __init__(
        self, vocab_size: int = 33278, nlayers: int = 2, nhid: int = 200, ninp: int = 128,
        nhead: int = 2,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.model: Transformer | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        h = self.hparams
        self.model = Transformer(
            vocab_size=h.vocab_size, nlayers=h.nlayers, nhid=h.nhid, ninp=h.ninp, nhead=h.nhead
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int = 0):
        input, target = batch
        assert self.model is not None
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        if self._trainer is not None:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def build(
    vocab_size: int = 33278,
    nlayers: int = 2,
    nhid: int = 200,
    ninp: int = 128,
    nhead: int = 2,
    seq_len: int = 32,
    batch_size: int = 2,
) -> tuple[LanguageModel, tuple[torch.Tensor, torch.Tensor]]:
    """The LightningModule (layers not built yet: ``configure_model`` does that) and an
    ``(input, target)`` batch of token ids, as the guide's WikiText2 loader yields them."""
    module = LanguageModel(vocab_size, nlayers, nhid, ninp, nhead)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), device="cpu")
    return module, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
