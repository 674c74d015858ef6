"""Benchmark: a checkpointed block's backward peak, on fake tensors (what the activation profile
measures) against real CPU tensors.

    python benchmarks/block_backward_measured.py [--seq 128 512] [--write PATH]

For a GPT block (examples/gpt.py tiny: LayerNorm, GELU MLP with biases, fused key/value) and a
Hugging Face Llama block (RMSNorm, SwiGLU, bias-free, rotary SDPA), at fp32 and bf16-mixed, at
each sequence length, under whole-block and op-level (selective) checkpointing: the most bytes
one block's backward holds at once beyond what the block saved, per sample, three ways:

- ``fake``: the activation profile's field (``ActivationProfile.checkpointed_backward`` /
  ``selective_backward``), measured on fake tensors in the profile of the meta-built model;
- ``real``: the same measuring code (:mod:`autoshard.predict.backward_peak`) on the same block
  built for real on the CPU, run on real tensors;
- ``MemTracker``: torch's own memory tracker around the same real recompute and backward (peak
  during backward less the bytes before it), an independent count of the real run.

Each as "with its parameters' gradients / without" (MemTracker: with only). bf16-mixed as the
trials run it: the block's parameters in bf16 (FSDP's ``param_dtype``) under CPU autocast.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from results_file import write_results  # benchmarks/, the script's own folder
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard import TargetSpec, WorkloadSpec, analyze_target, profile_activations  # noqa: E402
from autoshard.predict.backward_peak import (  # noqa: E402
    checkpointed_backward_peaks,
    first_calls,
)
from autoshard.predict.tracking import _restart_peak  # noqa: E402
from autoshard.sharding import selective_context  # noqa: E402

# name -> (target, kwargs but the sequence length, the block's class name)
SHAPES: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt-long": (
        f"{ROOT}/examples/gpt.py:build",
        {"size": "tiny", "vocab_size": 1024, "max_seq_len": 512},
        "Block",
    ),
    "llama-tiny": (
        f"{ROOT}/examples/hf_llama.py:build",
        {"size": "tiny", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
         "vocab_size": 1024, "batch_size": 1},
        "LlamaDecoderLayer",
    ),
}  # fmt: skip
PRECISIONS = ("32-true", "bf16-mixed")


def _target(name: str, seq: int) -> TargetSpec:
    spec, kwargs, _ = SHAPES[name]
    extra = {"seq_len": seq} if "hf_llama" in spec else {}
    return TargetSpec(spec=spec, kwargs={**kwargs, **extra})


def fake_peaks(name: str, seq: int) -> dict[str, dict[str, tuple[int, int]]]:
    """precision -> {"whole"|"selective": (with, without parameter gradients)} from the profile."""
    profile, built = analyze_target(_target(name, seq))
    acts = profile_activations(
        built.model, profile, WorkloadSpec(seq_len=seq), built.batch, precisions=PRECISIONS
    )
    return {
        a.precision.value: {"whole": a.checkpointed_backward, "selective": a.selective_backward}
        for a in (acts, *acts.others)
    }


def _real_block(name: str, seq: int, precision: str) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The first block of the model built for real on the CPU, and its first call's arguments."""
    from autoshard.target.resolve import load_callable
    from autoshard.target.step import forward

    target = _target(name, seq)
    torch.manual_seed(0)
    model, batch = _built(load_callable(target.spec)(**target.kwargs), seq)
    if precision != "32-true":
        model = model.to(torch.bfloat16)
    blocks = [m for m in model.modules() if type(m).__name__ == SHAPES[name][2]]
    with _autocast(precision), first_calls(blocks) as calls, torch.no_grad():
        forward(model, batch)
    args, kwargs = calls[0]
    return blocks[0], args, kwargs


def _built(built: Any, seq: int) -> tuple[nn.Module, Any]:
    model, batch = built if isinstance(built, tuple) else (built, None)
    if batch is None:
        vocab = model.tok_emb.num_embeddings
        batch = torch.randint(0, vocab, (1, seq))
    return model.train(), batch


def _autocast(precision: str) -> Any:
    if precision == "32-true":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16)


def real_peaks(name: str, seq: int, precision: str) -> dict[str, tuple[int, int, int]]:
    """{"whole"|"selective": (with, without parameter gradients, MemTracker's with)} on real
    tensors."""
    block, args, kwargs = _real_block(name, seq, precision)
    with _autocast(precision):
        peaks = checkpointed_backward_peaks([block], {0: (args, kwargs)}, [1])
        assert peaks is not None
        whole, selective = peaks
        tracked = {
            "whole": _mem_tracker_peak(block, args, kwargs, None),
            "selective": _mem_tracker_peak(block, args, kwargs, selective_context),
        }
    return {
        "whole": (whole.total, whole.activations_only, tracked["whole"]),
        "selective": (selective.total, selective.activations_only, tracked["selective"]),
    }


def _mem_tracker_peak(block: nn.Module, args: Any, kwargs: dict[str, Any], context_fn: Any) -> int:
    """torch's MemTracker around the block's checkpointed forward and backward: the peak during
    backward less the bytes live before it (the block's output, held here, is in both)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    from torch.utils.checkpoint import checkpoint

    kwargs = {k: None if k.startswith(("past_key", "layer_past")) else v for k, v in kwargs.items()}
    kwargs |= {"use_cache": False} if "use_cache" in kwargs else {}
    x = args[0].detach().requires_grad_()
    rest = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[1:])
    extra = {"context_fn": context_fn} if context_fn else {}
    params = [p for p in block.parameters() if p.requires_grad]
    tracker = MemTracker()
    tracker.track_external(block, x)
    with tracker:
        out = checkpoint(block, x, *rest, use_reentrant=False, **extra, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        _restart_peak(tracker)
        before = tracker.get_tracker_snapshot()[torch.device("cpu")][_TOTAL_KEY]
        # backward() (accumulating): the tracker's module hooks refuse autograd.grad()
        out.backward(torch.ones_like(out))
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")][_TOTAL_KEY]
    for p in params:
        p.grad = None
    return int(peak - before)


def rows(seqs: list[int]) -> list[list[str]]:
    table = []
    for name in SHAPES:
        for seq in seqs:
            fake = fake_peaks(name, seq)
            for precision in PRECISIONS:
                real = real_peaks(name, seq, precision)
                for policy in ("whole", "selective"):
                    f_with, f_without = fake[precision][policy]
                    r_with, r_without, tracked = real[policy]
                    table.append([
                        name, str(seq), precision, policy,
                        f"{f_with:,}", f"{r_with:,}", f"{tracked:,}",
                        f"{(f_with - tracked) / tracked:+.1%}",
                        f"{f_without:,}", f"{r_without:,}",
                        f"{(f_without - r_without) / r_without:+.1%}",
                    ])  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--write", type=Path, help="Write the table as markdown here.")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    header = [
        "block", "tokens", "precision", "checkpointing",
        "fake B", "real B", "MemTracker B", "fake vs MemTracker",
        "fake B, no param grads", "real B, no param grads", "error",
    ]  # fmt: skip
    table = rows(args.seq)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_results(args.write, text + "\n")


if __name__ == "__main__":
    main()
