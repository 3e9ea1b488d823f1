"""A step's sampling, isolated per request: the tokens and logprobs of the requests that
sample, and the prompt logprobs of those that asked for them. Everything runs batched; when
a batched call raises, it is redone one request at a time, so an error that belongs to one
request (its logits processing, its token, its logprobs, its grammar) ends that request
alone, and the others go on exactly as they would have without it."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from punica_x.core import TokenLogprob
from punica_x.runtime import Request
from punica_x.sampling.logprobs import record_prompt_logprobs, sampled_logprobs
from punica_x.sampling.sampler import NoTokenAllowed, Sampler

log = logging.getLogger(__name__)

Failed = dict[Request, str]  # requests whose own part of the step failed -> their error


def sample_step(
    sampler: Sampler,
    logits,
    sampling: list[Request],
    prompt_targets: tuple[tuple[Request, tuple[int, ...]], ...],
    failed: Failed,
) -> tuple[list[int | None], list[TokenLogprob | None]]:
    """The tokens and logprobs of the `sampling` requests (logits' first rows: [N, V]), and
    the prompt logprobs of `prompt_targets` (the rows after) recorded on their requests. A
    request whose own part fails gets None and its error in `failed` (see isolate)."""
    n = len(sampling)
    sample_logits = logits[:n]
    plain = all(r.plain and r.matcher is None for r in sampling)
    if plain and not prompt_targets and not failed:
        tokens = sampler.plain(sample_logits)  # one batched argmax, nothing per request
        if tokens is not None:
            return tokens, [None] * n

    def sample(rows: list[int]) -> list[int]:
        return sampler(_rows(sample_logits, rows), [sampling[i] for i in rows])

    tokens = isolate("sampling", sampling, failed, sample)

    def score(rows: list[int]) -> list[TokenLogprob | None]:
        picked = [sampling[i] for i in rows]
        return sampled_logprobs(_rows(sample_logits, rows), picked, [tokens[i] for i in rows])

    new_logprobs = isolate("logprobs", sampling, failed, score)
    if prompt_targets:
        record_prompts(logits[n:], prompt_targets, failed)
    return tokens, new_logprobs


def record_prompts(
    logits, targets: tuple[tuple[Request, tuple[int, ...]], ...], failed: Failed
) -> None:
    """Prompt logprobs of `targets` (request, prompt positions), scored from logits' rows in
    order; a request whose own scoring fails goes in `failed` (see isolate)."""
    starts = list(itertools.accumulate((len(p) for _, p in targets), initial=0))

    def record(rows: list[int]) -> list[None]:
        picked = tuple(targets[i] for i in rows)
        if len(picked) == len(targets):
            record_prompt_logprobs(logits, picked)
        else:
            lines = [j for i in rows for j in range(starts[i], starts[i + 1])]
            record_prompt_logprobs(logits[lines], picked)
        return [None] * len(rows)

    isolate("prompt logprobs", [r for r, _ in targets], failed, record)


def isolate(
    stage: str, requests: list[Request], failed: Failed, run: Callable[[list[int]], list]
) -> list:
    """run(rows) -> one result per row (indices into `requests`; it must change nothing when
    it raises), over the requests not in `failed`. All at once (the normal step costs
    nothing more); when that raises, one request at a time, so that an error that belongs to
    one request ends that request alone: it goes in `failed` with its error. Returns one
    result per request, None for the failed ones."""
    results: list = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r not in failed]
    if not rows:
        return results
    try:
        values = run(rows)
    except Exception as exc:
        log.warning("%s of a batch raised (%r): redone request by request", stage, exc)
        values = [_run_one(stage, requests[i], i, failed, run) for i in rows]
    for i, value in zip(rows, values):
        results[i] = value
    return results


def _run_one(stage: str, r: Request, row: int, failed: Failed, run: Callable[[list[int]], list]):
    try:
        return run([row])[0]
    except Exception as exc:
        failed[r] = request_error(r, stage, exc)
        return None


def request_error(r: Request, stage: str, exc: Exception) -> str:
    """The error a request ends with when its own part of a step raised (logged)."""
    if isinstance(exc, NoTokenAllowed):
        log.warning("request %s: %s", r.request_id, exc)
        return str(exc)
    error = f"{stage} failed: {type(exc).__name__}: {exc}"
    log.error("request %s: %s", r.request_id, error, exc_info=exc)
    return error


def _rows(logits, rows: list[int]):
    """The rows `rows` (increasing indices) of logits: logits itself when that is all of them."""
    return logits if len(rows) == logits.shape[0] else logits[rows]
