"""Benchmark: what torch.compile really keeps for backward, against the memory model's share.

    python benchmarks/compile_saved_measured.py [--seq-len 512] [--mbs 2]
        [--write benchmarks/results/compile_saved_measured.md]

One block of examples/gpt.py (a Llama-style block: RMSNorm, SwiGLU; a GPT-2 block: LayerNorm,
GELU), real tensors on the CPU, run eager and under ``torch.compile`` (inductor, AOTAutograd's
min-cut partitioner, as CPU trials compile), at bf16-mixed (CPU autocast) and 32-true. After one
forward, the tensors autograd keeps for backward are found by walking the graph from the loss
(every node's ``_saved_*`` tensors, and a compiled region's ``saved_tensors``), each storage
counted once. The share kept beyond the block's input is set against
:data:`autoshard.predict.recipe.COMPILE_SAVED_KEPT`, which both estimators use for a compiled,
non-checkpointed block (the simulation runs eager code and takes the same saving off:
:func:`autoshard.predict.analytic.compile_saving`).

What it cannot see: CUDA's attention kernels (flash / memory-efficient SDPA save their own
statistics; the CPU's SDPA saves what its flash kernel does), and a GPU's inductor may fuse
differently. A GPU run of the same script (it runs where CUDA is, with ``--device cuda``) settles
that.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import AbstractContextManager, suppress
from pathlib import Path

import torch
from results_file import write_results  # benchmarks/, the script's own folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

BLOCKS = {
    # name: (mlp, d_model, ffn_hidden, heads): the 7B preset's shape ratios, narrowed
    "llama-style (RMSNorm, SwiGLU)": ("swiglu", 256, 688, 8),
    "gpt2-style (LayerNorm, GELU)": ("gelu", 256, 1024, 8),
}


def saved_bytes(loss: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for ``loss``'s backward."""
    seen: set[int] = set()
    total, stack, visited = 0, [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        tensors: list[torch.Tensor] = []
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed, or not a tensor to read
                continue
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, (tuple, list)):
                tensors += [v for v in value if isinstance(v, torch.Tensor)]
        # a custom Function (a compiled region): its ctx's saved tensors
        with suppress(AttributeError, RuntimeError):
            tensors += [t for t in node.saved_tensors if isinstance(t, torch.Tensor)]
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        stack += [n for n, _ in node.next_functions]
    return total


def measure(mlp: str, d: int, hidden: int, heads: int, *, compiled: bool, bf16: bool,
            seq_len: int, mbs: int, device: str) -> tuple[int, int]:  # fmt: skip
    """(bytes kept for backward, bytes of the block's input) of one forward."""
    from gpt import Block

    torch.manual_seed(0)
    block = Block(d, heads, heads, hidden, mlp, True).to(device)
    leaf = torch.randn(mbs, seq_len, d, device=device, requires_grad=True)
    run = torch.compile(block) if compiled else block
    autocast: AbstractContextManager[object] = torch.autocast(
        device, dtype=torch.bfloat16, enabled=bf16
    )
    with autocast:
        x = leaf * 1.0  # a non-leaf input, as inside a model
        loss = run(x).float().sum()
    return saved_bytes(loss), x.numel() * x.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    from autoshard.predict.recipe import COMPILE_SAVED_KEPT

    rows = []
    start = time.perf_counter()
    for name, (mlp, d, hidden, heads) in BLOCKS.items():
        for bf16 in (True, False):
            shape = dict(seq_len=args.seq_len, mbs=args.mbs, device=args.device)
            eager, inp = measure(mlp, d, hidden, heads, compiled=False, bf16=bf16, **shape)
            comp, _ = measure(mlp, d, hidden, heads, compiled=True, bf16=bf16, **shape)
            kept = (comp - inp) / (eager - inp)
            precision = "bf16-mixed" if bf16 else "32-true"
            rows.append(
                f"| {name} | {precision} | {eager / 2**20:.2f} | {comp / 2**20:.2f} | "
                f"{kept:.2f} | {COMPILE_SAVED_KEPT:.2f} | {kept / COMPILE_SAVED_KEPT - 1:+.0%} |"
            )
            print(rows[-1], flush=True)
    seconds = time.perf_counter() - start
    text = (
        "# What torch.compile keeps for backward, measured against the memory model\n\n"
        f"`python benchmarks/compile_saved_measured.py --seq-len {args.seq_len} --mbs {args.mbs}"
        f"{' --device ' + args.device if args.device != 'cpu' else ''}`\n\n"
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.device}, "
        f"{seconds:.0f} s. One block of examples/gpt.py, micro-batch {args.mbs} x {args.seq_len} "
        "tokens, eager and torch.compile (inductor); MiB autograd keeps for backward after one "
        "forward (the block's input included); kept: the compiled share of the eager bytes "
        "beyond the input, which the model (COMPILE_SAVED_KEPT) sets for every block.\n\n"
        "| block | precision | eager MiB | compiled MiB | kept | model | model error |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |\n" + "\n".join(rows) + "\n"
    )
    print(text)
    if args.write:
        write_results(args.write, text)


if __name__ == "__main__":
    main()
