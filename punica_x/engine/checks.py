"""A request's refusals that depend only on the model and the KV pool (shared by runners and
the control plane in front: scheduler/runners/interface.py RequestLimits), and the errors of a
running request that outgrew them."""

from __future__ import annotations

import logging

from punica_x.core import FinishReason, SamplingParams
from punica_x.errors import ContextTooLong, InvalidRequest
from punica_x.kv.blocks import blocks_needed
from punica_x.runtime import Request

log = logging.getLogger("punica_x.engine.engine")


def check_request(
    ids: list[int],
    sampling: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    holder: str = "the KV cache holds",
) -> None:
    """The refusals of a request that depend only on the model and the KV pool's size
    (num_blocks: the most one request can hold; `holder` names it in the error), and an
    uncompilable JSON schema: InvalidRequest (ContextTooLong) naming the problem and the
    field; shared by runners and the control plane in front."""
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise ContextTooLong(
            f"the prompt has {len(ids)} tokens; the model's context is "
            f"{max_model_len} (room for at least one new token is needed)"
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside the vocabulary (size {vocab_size})", "prompt"
        )
    if blocks_needed(len(ids) + 1, block_size) > num_blocks:
        raise ContextTooLong(
            f"the prompt has {len(ids)} tokens; {holder} {num_blocks * block_size}"
        )
    bad = next((t for t, _ in sampling.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"logit_bias token id {bad} is outside the vocabulary (size {vocab_size})",
            "logit_bias",
        )
    if sampling.json_schema is not None:
        from punica_x.sampling.structured import compile_json_schema

        try:
            compile_json_schema(sampling.json_schema)  # cached: the matcher reuses it
        except ValueError as exc:
            raise InvalidRequest(str(exc), "response_format") from None


def too_big_error(r: Request, capacity_tokens: int, peers_lend: bool) -> str:
    """The error of a request that outgrew the whole KV cache (running alone, nothing left to
    preempt) or, under DistKV (peers_lend), all the blocks the cluster can give one request:
    it ends with LENGTH where it stands."""
    where = "cluster's KV caches hold" if peers_lend else "whole cache holds"
    return (
        f"the KV cache is full: the request needs room for {r.num_tokens} tokens and the "
        f"{where} {capacity_tokens} tokens, so it cannot fit even alone; it ends here "
        f"after {len(r.output_token_ids)} generated tokens"
    )


def starved_error(r: Request, give_up_s: float) -> str:
    """The error of a request whose peers lent it no KV block for KVBorrowing.give_up_s."""
    return (
        f"no peer runner lent the KV blocks this request needs ({r.num_tokens} tokens) for "
        f"{give_up_s:g} s: the cluster's free blocks are held by other requests; it ends "
        f"here after {len(r.output_token_ids)} generated tokens"
    )


def unschedulable(schedule, distkv, block_size: int, batcher) -> list[tuple]:
    """(request, finish reason, error) of each request a Schedule says cannot run, each error
    logged: too big for every cache (LENGTH), or starved of peers' blocks (ERROR). distkv:
    the engine's DistKVPart (what peers could lend)."""
    tokens = distkv.capacity_blocks() * block_size
    ending = [
        (r, FinishReason.LENGTH, too_big_error(r, tokens, distkv.peers_lend()))
        for r in schedule.overflow
    ]
    for r in schedule.starved:
        ending.append((r, FinishReason.ERROR, starved_error(r, batcher.borrowing.give_up_s)))
    for r, _, error in ending:
        log.warning("request %s: %s", r.request_id, error)
    return ending
