"""A request's refusals that depend only on the model and the KV pool (shared by runners and
the control plane in front: scheduler/runners/interface.py RequestLimits)."""

from __future__ import annotations

from punica_x.core import SamplingParams
from punica_x.errors import ContextTooLong, InvalidRequest
from punica_x.kv.blocks import blocks_needed


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
