"""The seed guide's own model: the Transformer from ``lightning.pytorch.demos``.

    autoshard analyze examples/lightning_transformer.py:build
    autoshard analyze examples/lightning_transformer.py:build --arg nlayers=32 --arg nhid=4096 \
        --arg ninp=1024 --arg nhead=64          # the guide's "1B parameters" configuration

Its blocks are ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``, the policy the
guide writes by hand: ``{nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}``.
Needs the lightning extra (``pip install 'autoshard[lightning]'``).
"""

from __future__ import annotations

import torch
from lightning.pytorch.demos import Transformer


def build(
    vocab_size: int = 33278,  # WikiText2's vocabulary, as in the guide
    nlayers: int = 2,
    nhid: int = 200,
    ninp: int = 128,
    nhead: int = 2,
    seq_len: int = 32,
    batch_size: int = 2,
) -> tuple[Transformer, tuple[torch.Tensor, torch.Tensor]]:
    """Build the demo Transformer and an example ``(input, target)`` batch of token ids.

    The demo's forward is ``model(input, target)`` and returns log-probabilities, trained with
    ``F.nll_loss(output, target.view(-1))`` as in the guide.
    """
    model = Transformer(vocab_size=vocab_size, nlayers=nlayers, nhid=nhid, ninp=ninp, nhead=nhead)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1))
    return model, (tokens[:, :-1], tokens[:, 1:])
