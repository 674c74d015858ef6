"""Time ``autoshard.recommend`` on Llama-3-8B (from a LlamaConfig, on meta) for 8 x 80 GiB.

    python benchmarks/recommend_llama8b.py            # prints the seconds and the reasons

Issue 6's bar: under 30 s on a 2-core machine with no GPU. Measured: the model build on meta,
and ``recommend`` (adapter, analysis, fake-tensor activation profile, every candidate's
estimate, choice and reasons), separately from importing torch and transformers.
"""

from __future__ import annotations

import argparse
import time
import warnings

start = time.perf_counter()
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import autoshard  # noqa: E402

imported = time.perf_counter()

warnings.simplefilter("ignore", autoshard.NoGPUWarning)
argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
config = LlamaConfig(
    hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
)  # fmt: skip
t0 = time.perf_counter()
with torch.device("meta"):
    model = LlamaForCausalLM(config)
t1 = time.perf_counter()
rec = autoshard.recommend(model, gpus=8, gpu_memory="80GiB", seq_len=4096)
t2 = time.perf_counter()

print(f"imports {imported - start:.1f} s (torch, transformers, autoshard)")
print(f"build on meta {t1 - t0:.2f} s; recommend {t2 - t1:.2f} s; total {t2 - t0:.2f} s")
print(f"{rec.profile.total_params:,} parameters; chosen: {rec.chosen.candidate.label()}")
print(f"{len(rec.runners_up)} runners-up, {len(rec.ruled_out)} ruled out")
for line in rec.reasons:
    print(" -", line)
