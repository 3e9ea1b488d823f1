"""Token sampling for a batch: logit bias and penalties, greedy, temperature, min-p, top-k,
top-p, per-request seeds. Every step is a tensor operation over the rows that use it; rows
that use none of them cost nothing."""

from __future__ import annotations

import torch

from punica_x.core import Request
from punica_x.structured import mask_constrained

_GOLDEN = 0x9E3779B97F4A7C15  # spreads (seed, step) pairs over the 64-bit seed space
_MASK = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request's `step`-th sampled token (0-based)."""
    return ((seed & _MASK) * _GOLDEN + step * 0xBF58476D1CE4E5B9 + 1) & _MASK


class Sampler:
    """Unseeded requests draw from the engine's generator. A request with a seed draws its
    n-th token from a generator seeded with step_seed(seed, n): its output depends only on
    its own seed and position, never on the batch it ran in or the runner it moved to."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._seeded = torch.Generator()

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [B, V] float32, one row per request -> one token id per request."""
        logits = process_logits(logits, requests)
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if random_rows:
            probs = self._probs(logits[random_rows].cpu(), [requests[i] for i in random_rows])
            for row, i in enumerate(random_rows):
                r = requests[i]
                gen = self.generator
                if r.sampling.seed is not None:
                    gen = self._seeded
                    gen.manual_seed(step_seed(r.sampling.seed, len(r.output_token_ids)))
                tokens[i] = int(torch.multinomial(probs[row], 1, generator=gen))
        return tokens

    @staticmethod
    def _probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, then min-p, top-k and top-p (nucleus) filtering; returns [B, V] probs."""
        temps = torch.tensor([r.sampling.temperature for r in requests], dtype=logits.dtype)
        logits = logits / temps[:, None]
        min_ps = torch.tensor([r.sampling.min_p for r in requests], dtype=logits.dtype)
        if (min_ps > 0).any():
            probs = logits.softmax(dim=-1)
            floor = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < floor, float("-inf"))
        vocab = logits.shape[-1]
        ks = [r.sampling.top_k if 0 < r.sampling.top_k < vocab else vocab for r in requests]
        if min(ks) < vocab:
            top = torch.topk(logits, max(ks), dim=-1).values
            kth = top.gather(1, torch.tensor(ks)[:, None] - 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_ps = torch.tensor([r.sampling.top_p for r in requests], dtype=logits.dtype)
        if (top_ps < 1).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            # drop a token when the tokens ranked above it already reach top_p
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_ps[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        return logits.softmax(dim=-1)


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits: [B, V] -> the same with logit_bias, repetition_penalty, frequency_penalty,
    presence_penalty and the JSON-schema masks applied (SamplingParams documents them).
    Returns `logits` itself when no request uses any, else a processed copy."""
    bias = [(i, t, b) for i, r in enumerate(requests) for t, b in r.sampling.logit_bias]
    penalized = [i for i, r in enumerate(requests) if _penalized(r)]
    constrained = any(r.matcher is not None for r in requests)
    if not bias and not penalized and not constrained:
        return logits
    logits = logits.clone()
    if bias:
        rows, cols, values = zip(*bias)
        logits.index_put_(
            (torch.tensor(rows), torch.tensor(cols)),
            torch.tensor(values, dtype=logits.dtype),
            accumulate=True,
        )
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [requests[i] for i in penalized])
    if constrained:
        mask_constrained(logits, requests)  # last: nothing re-enables a forbidden token
    return logits


def _penalized(r: Request) -> bool:
    sp = r.sampling
    return sp.repetition_penalty != 1 or sp.frequency_penalty != 0 or sp.presence_penalty != 0


def _penalize(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits: [P, V] of the penalized requests."""
    n, vocab = logits.shape
    counts = torch.zeros(n, vocab, dtype=logits.dtype)
    rows = [i for i, r in enumerate(requests) for _ in r.output_token_ids]
    cols = [t for r in requests for t in r.output_token_ids]
    if rows:
        counts.index_put_(
            (torch.tensor(rows), torch.tensor(cols)),
            torch.ones(len(rows), dtype=logits.dtype),
            accumulate=True,
        )
    seen = counts > 0
    prompt_rows = [i for i, r in enumerate(requests) for _ in r.prompt_token_ids]
    prompt_cols = [t for r in requests for t in r.prompt_token_ids]
    in_prompt = torch.zeros(n, vocab, dtype=torch.bool)
    in_prompt[torch.tensor(prompt_rows), torch.tensor(prompt_cols)] = True
    rep = torch.tensor([r.sampling.repetition_penalty for r in requests], dtype=logits.dtype)
    rep = rep[:, None]
    logits = torch.where(
        seen | in_prompt, torch.where(logits > 0, logits / rep, logits * rep), logits
    )
    freq = torch.tensor([r.sampling.frequency_penalty for r in requests], dtype=logits.dtype)
    pres = torch.tensor([r.sampling.presence_penalty for r in requests], dtype=logits.dtype)
    return logits - freq[:, None] * counts - pres[:, None] * seen.to(logits.dtype)
