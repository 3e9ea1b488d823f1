"""DistAttention (Infinite-LLM sec. 4; Lamina's overlap): attention of a step in which some
requests hold KV blocks on other runners.

A request's tokens are covered by segments in logical order: its local blocks first (its
block table), then each RemoteExtent it borrowed. Its rows' attention is the exact merge
(ScaleReduce, attention.merge) of one micro-attention per segment. For a segment holding
keys [t0, t1) and rows at positions [a, b) (b = kv_len):
- rows at positions in [t0, t1) attend causally: one SeqSpan (they are its last rows);
- rows at positions >= t1 see the whole segment: one single-row SeqSpan each;
- rows before t0 do not see it; the new K/V of rows in [t0, t1) is written there.
The local prefix runs through this runner's attention backend together with the requests
that hold no remote blocks (local blocks past it, brought home by DGFM or taken after the
request began borrowing, go through this runner's own rManager like a peer's); each remote
owner gets the query rows that see its blocks (and the
new K/V that lands there) once per layer, computes its micro-attentions where the blocks
live and returns (out, lse): KV never travels. With `overlap` the remote calls start on a
thread pool before the local attention runs and are collected after it (Lamina); without,
they run in the step's thread after it.

Batch-invariant (DistContext.fixed_order, ops.invariance): a merge of partial results sums in
another order than one kernel call over all the keys, so a request that borrowed would get
other bits than the same request on one runner. Instead each request's parts run one after
another in key order, the local part first, and each part goes on from the online-softmax
state the one before left ([R, H_q, D + 2]: attention.cpu's attend_state), finished once at
the end: the kernel's own sums block by block from position 0, the bits of one runner's
attention. The remote calls then run in rounds (a request's i-th remote extent in round i),
one after another, never overlapping the local part."""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from punica_x.attention.cpu import empty_state
from punica_x.attention.paged import SeqSpan
from punica_x.core import RemoteExtent
from punica_x.kv.rmanager import KVBorrower, MicroPlan


@dataclass(frozen=True)
class DistSeq:
    """A request of the step that holds remote blocks: rows [row_start, row_start +
    num_rows) are its last num_rows of kv_len tokens; block_ids are its local blocks (the
    first tokens), remote the rest."""

    row_start: int
    num_rows: int
    kv_len: int
    block_ids: list[int]
    remote: tuple[RemoteExtent, ...]
    request_id: str = ""


@dataclass(frozen=True)
class SegmentWork:
    """What one segment does for one request's rows. first_row: the first of the request's
    rows (offset from its row_start) that sees the segment; spans: in coordinates of the
    rows from first_row on; writes: (row offset, block, slot offset) of new K/V stored here."""

    first_row: int
    spans: tuple[SeqSpan, ...]
    writes: tuple[tuple[int, int, int], ...]


def segment_work(
    num_rows: int, kv_len: int, t0: int, block_ids: list[int] | tuple[int, ...], block_size: int
) -> SegmentWork | None:
    """The micro-attention of rows at positions [kv_len - num_rows, kv_len) over a segment
    whose blocks hold positions [t0, t0 + len(block_ids) * block_size); None when no row
    sees it (it is empty, or starts at or after kv_len)."""
    a, b = kv_len - num_rows, kv_len
    t1 = t0 + len(block_ids) * block_size
    if t0 >= b or t1 == t0:
        return None
    first = max(0, t0 - a)
    end = min(b, t1)
    lo = max(a, t0)
    blocks = list(block_ids)
    spans = []
    causal = end - lo
    if causal > 0:
        spans.append(SeqSpan(0, causal, end - t0, blocks))
    for j in range(max(causal, 0), num_rows - first):
        spans.append(SeqSpan(j, 1, t1 - t0, blocks))  # rows past the segment see all of it
    writes = tuple(
        (p - a, blocks[(p - t0) // block_size], (p - t0) % block_size) for p in range(lo, end)
    )
    return SegmentWork(first, tuple(spans), writes)


def shift(spans, rows: int) -> list[SeqSpan]:
    return [SeqSpan(s.row_start + rows, s.num_rows, s.kv_len, s.block_ids) for s in spans]


@dataclass
class _RemoteCall:
    owner: str
    q_rows: list[int] = field(default_factory=list)
    kv_rows: list[int] = field(default_factory=list)
    spans: list[SeqSpan] = field(default_factory=list)
    write_blocks: list[int] = field(default_factory=list)
    write_offsets: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    # (index of the DistSeq, first row offset in it, rows, offset in this call's q)
    items: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class RemoteStats:
    """Micro-attention calls this runner sent to its creditors and their summed round trips
    (seconds from sending the query to holding (out, lse); with overlap, they run while the
    local part does). Read from other threads for metrics: counters, not a ledger."""

    calls: int = 0
    seconds: float = 0.0


@dataclass
class DistContext:
    """What a runner needs to plan DistAttention: its id, its peers, a thread pool for the
    remote calls (None: run them in the step's thread) and whether they overlap the local
    attention."""

    runner_id: str
    borrower: KVBorrower
    pool: Executor | None = None
    overlap: bool = False
    stats: RemoteStats = field(default_factory=RemoteStats)
    fixed_order: bool = False  # the batch-invariant mode: the parts chained (module doc)


def plan_dist(
    backend,
    plain: list[SeqSpan],
    seqs: list[DistSeq],
    num_rows: int,
    block_size: int,
    device: torch.device,
    ctx: DistContext,
) -> DistPlan:
    """plain: spans of the requests with local KV only (full-batch row coordinates)."""
    local_spans = list(plain)
    writes: list[tuple[int, int, int]] = []
    for sp in plain:
        for pos in range(sp.kv_len - sp.num_rows, sp.kv_len):
            row = sp.row_start + pos - (sp.kv_len - sp.num_rows)
            writes.append((row, sp.block_ids[pos // block_size], pos % block_size))
    covered = torch.zeros(num_rows, dtype=torch.bool)
    for sp in plain:
        covered[sp.row_start : sp.row_start + sp.num_rows] = True
    calls = _split_segments(seqs, block_size, local_spans, writes, covered, ctx.fixed_order)
    merge = getattr(backend, "merge_rows", None)  # a fused merge (the CPU backend has one)
    finish = _finisher(backend) if ctx.fixed_order else None
    ordered = sorted(calls.items(), key=lambda item: item[0][0])  # by round (stable)
    remote = [_prepare_call(call, seqs, merge, device, ctx) for _, call in ordered]
    local = backend.plan(local_spans, block_size, device)
    w = list(zip(*writes)) if writes else ([], [], [])
    uncovered = (~covered).nonzero().flatten().to(device)
    return DistPlan(
        local=local,
        seqs=seqs,
        remote=remote,
        write_rows=_ints(w[0], device),
        write_blocks=_ints(w[1], device),
        write_offsets=_ints(w[2], device),
        uncovered=uncovered,
        pool=ctx.pool,
        overlap=ctx.overlap,
        stats=ctx.stats,
        merge=merge,
        finish=finish,
    )


def _finisher(backend):
    """backend.finish_state, where the chained parts end (ValueError for a backend without
    one: the batch-invariant mode's DistKV needs the CPU kernel's state)."""
    finish = getattr(backend, "finish_state", None)
    if finish is None:
        raise ValueError(
            f"batch-invariant DistKV needs the cpu attention kernel, not {backend.name!r}"
        )
    return finish


def _split_segments(
    seqs: list[DistSeq],
    block_size: int,
    local_spans: list[SeqSpan],
    writes: list[tuple[int, int, int]],
    covered: torch.Tensor,
    rounds: bool = False,
) -> dict[tuple[int, str], _RemoteCall]:
    """Each sequence's KV segments: its local prefix joins `local_spans` / `writes` /
    `covered` (one backend plan with the plain requests); the extents on each peer become
    that peer's call, keyed (0, owner): one micro-attention call per owner. rounds: keyed
    (i, owner) for a sequence's i-th extent, so that the calls of round i can go on from
    round i - 1's state (the chained order)."""
    calls: dict[tuple[int, str], _RemoteCall] = {}
    for si, seq in enumerate(seqs):
        t0 = 0
        segments = [(None, seq.block_ids)] + [(e.owner, e.block_ids) for e in seq.remote]
        for i, (owner, blocks) in enumerate(segments):
            work = segment_work(seq.num_rows, seq.kv_len, t0, blocks, block_size)
            t0 += len(blocks) * block_size
            if work is None:
                continue
            base = seq.row_start + work.first_row
            seen = seq.num_rows - work.first_row
            if owner is None:  # the local prefix: with the plain requests in one backend plan
                local_spans += shift(work.spans, base)
                covered[base : base + seen] = True
                writes += [(seq.row_start + r, blk, off) for r, blk, off in work.writes]
                continue
            key = (i if rounds else 0, owner)
            call = calls.setdefault(key, _RemoteCall(owner))
            call.items.append((si, work.first_row, seen, len(call.q_rows)))
            call.spans += shift(work.spans, len(call.q_rows))
            call.q_rows += range(base, base + seen)
            for r, blk, off in work.writes:
                call.kv_rows.append(seq.row_start + r)
                call.write_blocks.append(blk)
                call.write_offsets.append(off)
            if seq.request_id not in call.request_ids:
                call.request_ids.append(seq.request_id)
    return calls


def _prepare_call(call: _RemoteCall, seqs: list[DistSeq], merge, device, ctx: DistContext):
    """The peer prepares its micro-attention for this step; returns (call, its prepared
    micro-attention, q rows, kv rows, (dst, src) merge pairs or None)."""
    plan = MicroPlan(
        tuple(call.request_ids),
        tuple(call.spans),
        tuple(call.write_blocks),
        tuple(call.write_offsets),
    )
    micro = ctx.borrower.peer(call.owner).prepare(ctx.runner_id, plan)
    pairs = None
    if merge is not None and not ctx.fixed_order:  # row of the batch <- row of (out, lse)
        dst = [seqs[si].row_start + first + j for si, first, n, _ in call.items for j in range(n)]
        src = [at + j for _, _, n, at in call.items for j in range(n)]
        pairs = (_ints(dst, device), _ints(src, device))
    return call, micro, _index(call.q_rows, device), _index(call.kv_rows, device), pairs


def _ints(xs, device) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64, device=device)


def _index(rows: list[int], device) -> slice | torch.Tensor:
    """Rows as a slice when they are consecutive (a view, no gather), else an index."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return _ints(rows, device)


def merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, s: torch.Tensor) -> None:
    """ScaleReduce in place: (out, lse) [R, H, D], [R, H] absorb a part (o, s) over other
    keys. The part's weight is exp(s - logaddexp(lse, s)) = sigmoid(s - lse), so the merge
    is one lerp; s must be finite (a part that sees at least one key)."""
    s = s.to(lse.device)  # a remote part may come back on the host (the channel's bytes)
    w = torch.sigmoid(s - lse).unsqueeze(-1)
    out.lerp_(o.to(out.device, out.dtype), w.to(out.dtype))
    torch.logaddexp(lse, s, out=lse)


@dataclass
class DistPlan:
    """The step's attention plan when some request holds remote blocks (same interface as
    a backend's plan: write_kv, then attend, per layer)."""

    local: object
    seqs: list[DistSeq]
    remote: list
    write_rows: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    uncovered: torch.Tensor
    pool: Executor | None
    overlap: bool
    stats: RemoteStats
    merge: object | None = None  # backend.merge_rows, or None: merge_into per run of rows
    # the batch-invariant order (module doc): backend.finish_state; None: the parts merged
    finish: object | None = None
    _k: torch.Tensor | None = None
    _v: torch.Tensor | None = None

    def write_kv(self, kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new K/V rows that land in local blocks; keep the rest for attend()."""
        if self.write_rows.numel():
            kv[self.write_blocks, layer, 0, :, self.write_offsets] = k[self.write_rows]
            kv[self.write_blocks, layer, 1, :, self.write_offsets] = v[self.write_rows]
        self._k, self._v = k, v

    def attend(self, q, kv, layer: int, scale: float, window: int = 0, softcap: float = 0.0):
        """q: [T, H_q, D] -> (out [T, H_q, D], lse [T, H_q] float32), merged over every
        runner holding a part of each request's keys. A sliding window or soft-capping is
        not supported here (DistKVPart.enable refuses such models)."""
        if window or softcap:
            raise NotImplementedError("DistAttention with a sliding window or soft-capping")
        if self.finish is not None:
            return self._attend_chained(q, kv, layer, scale)
        k, v = self._k, self._v
        pending = []
        if self.overlap:
            pending = [self._start(call, layer, q, k, v, scale) for call in self.remote]
        out, lse = self.local.attend(q, kv, layer, scale)
        if self.uncovered.numel():  # rows whose request has no local key they can see
            out[self.uncovered] = 0
            lse[self.uncovered] = float("-inf")
        if not self.overlap:
            pending = [self._start(call, layer, q, k, v, scale) for call in self.remote]
        for (call, _, _, _, pairs), result in zip(self.remote, pending):
            o, s, seconds = result.result() if isinstance(result, Future) else result
            o, s = o.to(out.device), s.to(lse.device)  # the channel delivers host tensors
            self.stats.calls += 1
            self.stats.seconds += seconds
            if pairs is not None:
                self.merge(out, lse, o.to(out.dtype).contiguous(), s.contiguous(), *pairs)
                continue
            for si, first, n, at in call.items:  # consecutive rows of one request
                r0 = self.seqs[si].row_start + first
                merge_into(out[r0 : r0 + n], lse[r0 : r0 + n], o[at : at + n], s[at : at + n])
        return out, lse

    def _attend_chained(self, q, kv, layer: int, scale: float):
        """Every request's parts in key order, each going on from the state the one before
        left (the local part, then the remote calls round by round), finished once."""
        state = empty_state(*q.shape)
        self.local.attend_state(q, kv, layer, scale, state)
        for _, micro, q_rows, kv_rows, _ in self.remote:
            args = (layer, q[q_rows], self._k[kv_rows], self._v[kv_rows], scale)
            t0 = time.perf_counter()
            part = micro.run(*args, state=state[q_rows].contiguous())
            self.stats.calls += 1
            self.stats.seconds += time.perf_counter() - t0
            state[q_rows] = part.to(state.device)
        return self.finish(state, q.dtype)

    def _start(self, entry, layer, q, k, v, scale):
        call, micro, q_rows, kv_rows, _ = entry
        args = (micro, layer, q[q_rows], k[kv_rows], v[kv_rows], scale)
        if self.pool is None or not self.overlap:  # in this thread, after the local part
            return _timed(*args)
        return self.pool.submit(_timed, *args)


def _timed(micro, layer, q, k, v, scale):
    """micro.run's (out, lse) and its round trip in seconds."""
    t0 = time.perf_counter()
    out, lse = micro.run(layer, q, k, v, scale)
    return out, lse, time.perf_counter() - t0
