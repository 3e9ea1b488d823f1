"""Token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from punica_x.core import Request


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [B, V] float32, one row per request -> one token id per request."""
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if random_rows:
            probs = self._probs(logits[random_rows].cpu(), [requests[i] for i in random_rows])
            for row, i in enumerate(random_rows):
                gen = requests[i].generator or self.generator
                tokens[i] = int(torch.multinomial(probs[row], 1, generator=gen))
        return tokens

    @staticmethod
    def _probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, then top-k, then top-p (nucleus) filtering; returns [B, V] probs."""
        temps = torch.tensor([r.sampling.temperature for r in requests], dtype=logits.dtype)
        logits = logits / temps[:, None]
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
