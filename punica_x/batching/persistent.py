"""The persistent batch of decode steps (vLLM v1's InputBatch, for the steady state): a step
whose rows are all single-token decodes of requests that ran in the step before is planned
from that step's tensors moved on by deltas, with no per-request Python beyond reading each
request's position and input token.

Kept between steps (DecodeRows): the last step's requests in row order and, per row, its KV
length after that step and its block table (int32 [S, W], padded with block 0; built from the
requests' block_ids the first time a step is planned this way, then kept up to date). A decode
step over a subset of those requests, in any order:
- gathers their rows of the tables and the lengths (torch.index_select: requests that left
  are the delta), adds one to the lengths;
- writes the one new block of each request whose new token starts a block (its block_ids only
  grow while it runs: a preempted request restarts from a shorter length and is replanned);
- hands the tables and lengths to the attention backend's decode_plan (attention backends
  without one are planned from spans every step: paged.py, flashinfer, Lamina);
- takes the input tokens from the requests (an overlapped step's in-flight tokens become
  input fills, all in one tensor: InputFills).
Anything else (a prefill chunk, a request that did not run in the last step, one whose length
is not the last step's plus its token, remote KV, prompt logprobs to score) is planned from
spans by BatchPlanner, and the rows kept are that step's. An engine that swaps KV to the host
(MLFQ) keeps no rows: a swap-in gives a request new blocks at the same length."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica_x.batching.schedule import ScheduledRequest
from punica_x.host_ints import int64
from punica_x.runtime import InputFills, Request

NOT_A_DECODE = -2  # _decode_input: the row is not the request's last token
IN_FLIGHT = -1  # _decode_input: the input token is on the device (an overlapped step)


def _decode_input(r: Request, start: int) -> int:
    """The input token of r's decode row at `start` (a token id), IN_FLIGHT when it is on the
    device, NOT_A_DECODE when the row is not r's last token."""
    out = r.output_token_ids
    k = start - len(r.prompt_token_ids)  # the row's token is output k (a prompt's if < 0)
    if r.num_inflight:  # the last token is on the device (at most one: overlap.py)
        return IN_FLIGHT if k == len(out) else NOT_A_DECODE
    if k + 1 != len(out):
        return NOT_A_DECODE
    return out[k] if k >= 0 else r.prompt_token_ids[start]


@dataclass
class DecodeStep:
    """A decode step planned from the kept rows: input_ids, positions [S] int64, the attention
    backend's plan, its in-flight inputs (InputFills or None)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: object
    fills: InputFills | None
    same_rows: bool  # the rows of the kept step, a decode too: the same rows in the same order


class DecodeRows:
    """The rows kept from the last step (see the module). block_size: the KV cache's;
    attention: the backend, whose decode_plan(tables, kv_len, block_size, device) makes the plan;
    device: where the plan's tensors go."""

    def __init__(self, block_size: int, attention, device: torch.device) -> None:
        self.block_size = block_size
        self.attention = attention
        self.device = device
        self.requests: list[Request] = []
        self.kv_len = torch.zeros(0, dtype=torch.int64)  # [S] after the last step
        self.tables: torch.Tensor | None = None  # int32 [S, W]; None: not built yet
        self._index: dict[int, int] | None = None  # id(request) -> row, built when asked
        self._decoded = False  # the kept step was a decode planned here (a row a request)
        self.advances = 0  # steps planned from the kept rows (tests, metrics)

    def keep(self, requests: list[Request], kv_len: list[int]) -> None:
        """A step planned from spans ran these requests (row order), each holding kv_len[i]
        tokens of KV after it; its tables are built if the next step is a decode of them."""
        self.requests = requests
        self.kv_len = int64(kv_len)
        self.tables = None
        self._index = None
        self._decoded = False

    def forget(self) -> None:
        """Nothing kept: the next step is planned from spans."""
        self.keep([], [])

    def advance(self, ordered: list[ScheduledRequest]) -> DecodeStep | None:
        """The step of `ordered` (the planner's row order) from the kept rows, or None when it
        is not a decode of them (the caller plans it from spans and keeps its rows)."""
        n = len(ordered)
        if not n or not self.requests or sum(s.num_new_tokens for s in ordered) != n:
            return None
        requests = [s.request for s in ordered]
        index = self._index
        if index is None:
            index = self._index = _index(self.requests)
        rows = [index.get(id(r), -1) for r in requests]
        if -1 in rows:
            return None
        starts = [r.num_computed_tokens for r in requests]
        inputs = list(map(_decode_input, requests, starts))
        if NOT_A_DECODE in inputs:
            return None
        rows_t, positions = int64(rows), int64(starts)
        if not torch.equal(self.kv_len.index_select(0, rows_t), positions):
            return None  # recomputed, or ran more than one token since
        if self.tables is None:
            self.tables = _tables(self.requests, self.kv_len.tolist(), self.block_size)
        tables = self.tables.index_select(0, rows_t)
        tables = self._new_blocks(tables, requests, positions)
        kv_len = positions + 1
        plan = self.attention.decode_plan(tables, kv_len, self.block_size, self.device)
        same = self._decoded and n == len(self.requests) and rows == list(range(n))
        self.requests, self.kv_len, self.tables, self._decoded = requests, kv_len, tables, True
        if not same:  # the same rows keep their index
            self._index = None
        self.advances += 1
        fills = _fills(requests, inputs)
        return DecodeStep(_input_ids(inputs), positions, plan, fills, same)

    def _new_blocks(
        self, tables: torch.Tensor, requests: list[Request], positions: torch.Tensor
    ) -> torch.Tensor:
        """tables with the block of each row whose position starts a block written in (wider
        by a column when a row's block index reaches the width)."""
        size = self.block_size
        starting = (positions % size == 0).nonzero().flatten().tolist()
        if not starting:
            return tables
        col = int(positions.max()) // size
        if col >= tables.shape[1]:
            pad = torch.zeros(tables.shape[0], col + 1 - tables.shape[1], dtype=tables.dtype)
            tables = torch.cat([tables, pad], dim=1)
        for i in starting:
            r, pos = requests[i], int(positions[i])
            tables[i, pos // size] = r.block_ids[pos // size]
        return tables


def _index(requests: list[Request]) -> dict[int, int]:
    """id(request) -> its row, for the requests a decode step may plan from the kept rows:
    not those with remote KV (DistKV plans from spans) or prompt logprobs to score."""
    return {
        id(r): i
        for i, r in enumerate(requests)
        if not r.remote and r.sampling.prompt_logprobs is None
    }


def _tables(requests: list[Request], kv_len: list[int], block_size: int) -> torch.Tensor:
    """int32 [S, W]: each request's blocks for its kv_len tokens, padded with block 0."""
    lists = [r.block_ids[: -(-n // block_size)] for r, n in zip(requests, kv_len)]
    width = max(map(len, lists), default=1) or 1
    return torch.tensor([b + [0] * (width - len(b)) for b in lists], dtype=torch.int32)


def _input_ids(inputs: list[int]) -> torch.Tensor:
    """The step's input ids [S] int64, in-flight ones 0 until filled."""
    return int64(inputs).clamp_(min=0)


def _fills(requests: list[Request], inputs: list[int]) -> InputFills | None:
    """Each in-flight input's row and the previous step's sample row that will hold it."""
    if IN_FLIGHT not in inputs:
        return None
    if max(inputs) < 0:  # every input in flight: the steady state of overlapped steps
        where = torch.arange(len(inputs), dtype=torch.int64)
        source = int64([r.inflight_row for r in requests])
        return InputFills(where, source)
    pairs = [(i, r.inflight_row) for i, (r, t) in enumerate(zip(requests, inputs)) if t < 0]
    return InputFills.of(pairs)
