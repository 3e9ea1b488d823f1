"""Log-probabilities for the requests that ask for them, from the logits the step already
computed: nothing is computed for the others. Values are of the raw model distribution
(log_softmax of the float32 logits, before temperature and top-k/top-p), as vLLM returns by
default and as evaluation harnesses expect."""

from __future__ import annotations

import torch

from punica_x.core import TokenLogprob
from punica_x.runtime import Request


def _score(logits: torch.Tensor, token_ids: list[int], tops: list[int]) -> list[TokenLogprob]:
    """logits: [N, V] float32; token_ids, tops: [N] -> N entries (token's logprob + tops[i]
    most likely alternatives)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device)[:, None])[:, 0].tolist()
    k = max(tops)
    if k:
        top_vals, top_ids = logp.topk(k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out = []
    for i, (token, value) in enumerate(zip(token_ids, chosen)):
        top = tuple(zip(top_ids[i][: tops[i]], top_vals[i][: tops[i]])) if k else ()
        out.append(TokenLogprob(token, value, top))
    return out


def sampled_logprobs(
    logits: torch.Tensor, requests: list[Request], tokens: list[int]
) -> list[TokenLogprob | None]:
    """logits: [B, V], one row per sampled request -> per request the sampled token's entry,
    or None where SamplingParams.logprobs is None."""
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(requests)
    if rows:
        scored = _score(
            logits[rows],
            [tokens[i] for i in rows],
            [requests[i].sampling.logprobs for i in rows],
        )
        for i, entry in zip(rows, scored):
            result[i] = entry
    return result


def record_prompt_logprobs(
    logits: torch.Tensor, targets: tuple[tuple[Request, tuple[int, ...]], ...]
) -> None:
    """logits: [P, V], the rows scoring `targets` (per request, the prompt positions, in
    order); appends to each request's prompt_logprobs (entry 0, None, is set on arrival).
    All or nothing: when it raises, no request's prompt_logprobs has changed."""
    token_ids, tops = [], []
    for r, positions in targets:
        expected = range(len(r.prompt_logprobs), len(r.prompt_logprobs) + len(positions))
        assert tuple(positions) == tuple(expected), (len(r.prompt_logprobs), positions)
        token_ids.extend(r.prompt_token_ids[t] for t in positions)
        tops.extend([r.sampling.prompt_logprobs] * len(positions))
    scored = iter(_score(logits, token_ids, tops))
    for r, positions in targets:
        r.prompt_logprobs.extend(next(scored) for _ in positions)
