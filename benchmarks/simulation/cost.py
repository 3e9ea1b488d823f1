"""What a simulated step costs: StepCost(tokens computed, distinct adapters, KV tokens
attended), and the profiles fitted to a real runner (cpu) or Punica's published A100 figures
(a100)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica_x.kv.blocks import KVCacheSpec

# A block holds no data here: 1 layer, 1 head, 1 dim (the batcher only counts blocks).
EMPTY_SPEC = KVCacheSpec(1, 1, 1, 16, torch.float32)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step: base + per computed token (prefill or decode) + per
    distinct adapter in the batch (SGMV segments) + per KV token attended; plus swap_block_s
    for each KV block the MLFQ batcher swapped out or in before the step (a synchronous
    copy, the worst case: on a GPU proactive swaps overlap compute)."""

    name: str
    base_s: float
    token_s: float
    adapter_s: float
    kv_token_s: float
    kv_blocks: int  # KV pool of a runner
    max_batch_size: int = 32
    output_median: int = 24  # output-length distribution sized to the profile's speed
    swap_block_s: float = 0.0
    swap_blocks: int | None = None  # host pool of the MLFQ batcher (None: as many as kv_blocks)

    def __call__(self, tokens: int, adapters: int, kv_tokens: int) -> float:
        return (
            self.base_s
            + self.token_s * tokens
            + self.adapter_s * adapters
            + self.kv_token_s * kv_tokens
        )


PROFILES = {
    # Punica (sec. 2 and 7): Llama-2-7B fp16 on an A100. Decode: 11 ms at batch 1,
    # 13 ms at 32 (short sequences) -> 0.065 ms a token; 34 ms at 32 long (2k) sequences ->
    # 0.32 us a KV token; LoRA adds ~2 ms a step over 32 adapters -> 0.06 ms an adapter.
    # Prefill is compute-bound: 14 GFLOP a token at ~200 TFLOP/s -> 0.07 ms (the token term).
    # KV: 80 GB - 14 GB of weights at 0.5 MB a token = ~130k tokens = 8k blocks.
    # A block of 16 tokens is 8 MB: 0.32 ms a way over PCIe 4 x16 (25 GB/s).
    "a100": StepCost(
        "a100 (Punica, Llama-2-7B)", 0.011, 0.065e-3, 0.06e-3, 0.32e-6, 8000, 32, 128, 0.32e-3
    ),
    # SmolLM2-135M fp32 on the 2-core AVX2 EPYC (benchmarks/results/avx2): a batch of 32
    # decodes takes 68 ms without adapters and 94 ms with 32 distinct rank-16 ones
    # (profile_step) -> 0.8 ms an adapter; a single request's step ~25 ms, and a 512-token
    # prefill ~0.9 s (bench_migration's recompute fit: ~1 ms a token + a quadratic term
    # folded into the KV term). KV: 2 GiB at 46 KB a token = ~2900 blocks.
    # A block is 0.74 MB: ~0.15 ms a way as a memcpy; the host pool is the engine's default
    # swap_bytes, 1 GiB = 1400 blocks.
    "cpu": StepCost(
        "cpu (SmolLM2-135M, 2-core AVX2 EPYC)",
        0.022,
        1.4e-3,
        0.8e-3,
        2.0e-6,
        2900,
        32,
        24,
        0.15e-3,
        1400,
    ),
}
