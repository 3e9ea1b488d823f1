"""A request moving between runners (Punica sec. 5.3), the runner's half: where a request
stands when it leaves (`resume_point`, with a copy of its KV for a live copy), and taking
one in from there (`resume_into`: its generated tokens are recomputed with the prompt, or
its KV copy imported)."""

from __future__ import annotations

import contextlib
import logging

from punica_x.core import KVSnapshot, Resume
from punica_x.kv.blocks import KVCache, blocks_needed
from punica_x.kv.rmanager import PeerLost
from punica_x.kv.swap import SwapPool
from punica_x.runtime import Request
from punica_x.sampling.detokenizer import Detokenizer

log = logging.getLogger(__name__)


def resume_into(
    req: Request,
    resume: Resume,
    max_model_len: int,
    vocab_size: int,
    detokenizer: Detokenizer,
    cache: KVCache,
) -> None:
    """Continue `req` (new here, not yet queued) from `resume`. Raises ValueError when the
    resume point leaves nothing to generate or holds impossible token ids."""
    tokens = list(resume.output_token_ids)
    if len(tokens) >= req.sampling.max_tokens:
        raise ValueError("a resumed request has no tokens left to generate")
    if len(req.prompt_token_ids) + len(tokens) >= max_model_len:
        raise ValueError("a resumed request has no room left in the model's context")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise ValueError("a resumed request has token ids outside the vocabulary")
    req.output_token_ids = tokens
    req.num_preemptions = resume.num_preemptions
    if req.sampling.logprobs is not None:
        req.logprobs = list(resume.logprobs)
    if req.sampling.prompt_logprobs is not None and resume.prompt_logprobs is not None:
        req.prompt_logprobs = list(resume.prompt_logprobs)
    if req.matcher is not None:
        for t in tokens:
            req.matcher.consume_token(t)
    sp = req.sampling
    detokenizer.prime(req.request_id, tokens, sp.skip_special_tokens, resume.emitted_chars)
    if resume.kv is not None:  # last: nothing after it can refuse the request
        import_kv(cache, req, resume.kv)


def import_kv(cache: KVCache, req: Request, kv: KVSnapshot) -> None:
    """Take a live copy's KV. Without room for it, the request recomputes instead, as if no
    KV had come (the scheduler placed it where there was room, so this is rare)."""
    data = kv.blocks
    if tuple(data.shape[1:]) != cache.block_shape:
        raise ValueError(
            f"the KV copy has blocks of shape {tuple(data.shape[1:])}; this runner's are "
            f"{cache.block_shape}"
        )
    n = min(kv.num_tokens, req.num_tokens - 1)  # at least one token left to compute
    if n <= 0 or data.shape[0] < blocks_needed(n, cache.block_size):
        return
    if not cache.ensure_capacity(req.block_ids, n):
        log.info("no KV room for %s's copy: it recomputes", req.request_id)
        return
    try:
        cache.import_blocks(req.block_ids, data)
    except PeerLost as exc:  # an attention worker that held its slice is gone: the next
        log.warning("KV copy of %s not imported (%s): it recomputes", req.request_id, exc)
        return  # step meets the loss (engine/lamina_part.py) and replaces the worker
    req.num_computed_tokens = n


def resume_point(
    req: Request,
    detokenizer: Detokenizer,
    cache: KVCache,
    swap: SwapPool | None,
    with_kv: bool,
) -> Resume:
    """Where `req` stands, to continue it on another runner. with_kv: with a copy of its
    computed KV (none for a request with borrowed blocks, or whose prompt logprobs are not
    all computed: those recompute)."""
    kv = None
    prompt_done = len(req.prompt_logprobs) == len(req.prompt_token_ids)
    partial_prompt_logprobs = req.sampling.prompt_logprobs is not None and not prompt_done
    local = not req.remote  # borrowed blocks stay where they are: it recomputes
    if with_kv and local and req.num_computed_tokens > 0 and not partial_prompt_logprobs:
        n = req.num_computed_tokens
        if req.host_block_ids:  # swapped out by the MLFQ batcher
            kv = KVSnapshot(n, swap.export(req))
        else:
            with contextlib.suppress(PeerLost):  # its KV is lost with a worker: it recomputes
                kv = KVSnapshot(n, cache.export_blocks(req.block_ids, n))
    return Resume(
        output_token_ids=tuple(req.output_token_ids),
        emitted_chars=detokenizer.emitted(req.request_id),
        logprobs=tuple(req.logprobs),
        prompt_logprobs=tuple(req.prompt_logprobs) if prompt_done else None,
        num_preemptions=req.num_preemptions,
        kv=kv,
    )
