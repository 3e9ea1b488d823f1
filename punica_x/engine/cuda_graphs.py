"""Decode steps replayed from CUDA graphs at bucketed batch sizes.

A decode step of an 8B model launches ~30 kernels a layer; on a GPU the host's launches and
Python take most of the step (bench_generate on an H200: the GPU busy 30-45% of it). A step
whose rows are all decodes is instead copied into the fixed buffers of a graph captured once
for its shape, and replayed: one launch for the whole forward, SGMV and attention included.

Shapes: the batch is padded up to a size of BATCH_BUCKETS (the padding rows repeat the last
real row: same token, position, KV slot, block table and adapter, so the K/V they write are
the real row's and their logits are never read), and each block table up to a width bucket
(a power of two from MIN_WIDTH_BLOCKS up, capped at max_model_len's blocks; the keys past a
row's length are masked as in eager). SGMV runs one one-row segment per row: each row's
adapter pointers and ranks are gathered into the graph's tables on the device, so any mix
of adapters replays the same graph; the launch grid is fixed by the row count. A batch
without any adapter replays a graph without the LoRA launches (the backbone's own cost).

Graphs for every batch bucket at the smallest width are captured when the engine starts
(logged); a wider one is captured the first time a step needs it. Steps the graphs do not
cover run eagerly, as they would without graphs: prefill or mixed steps, prompt logprobs,
LoRA on the embedding or the LM head, DistKV, an attention backend other than "torch" or
the batch-invariant "triton" (engine/graph_attention.py: their plans' fixed buffers; the
FlashInfer backend plans its own buffers per step), more rows than the largest bucket, a
rank above the engine's max_lora_rank, or a capture that failed (logged once, counted).

The capture function is injectable: `cuda_capture` on a GPU; tests on the CPU pass
`replay_capture`, which "replays" by running the forward again on the same fixed buffers,
so the buffer plumbing (padding, width buckets, per-row adapter tables) is tested where no
GPU is."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from punica_x.engine.graph_attention import BUFFERS, TorchDecodeBuffers, put
from punica_x.ops.sgmv_weights import SgmvWeights
from punica_x.runtime import Batch, LoraBatchMeta

log = logging.getLogger("punica_x.engine.cuda_graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WIDTH_BLOCKS = 16
MAX_GRAPHS = 96  # past this many captured shapes, a new shape runs eagerly

# capture(fn, pool, device) -> (replay, out): out is fn's output, rewritten by each replay()
Capture = Callable[[Callable[[], torch.Tensor], object, torch.device], tuple]


def cuda_capture(fn, pool, device: torch.device):
    """fn once on a side stream (lazy initialisation: cuBLAS workspaces, kernel loads), then
    captured into a CUDA graph sharing `pool` with the other decode graphs."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


def replay_capture(fn, pool, device: torch.device):
    """The CPU stand-in: "replay" runs fn again and writes its result into the first output,
    as a graph's replay rewrites its output in place."""
    out = fn()

    @torch.inference_mode()  # out is an inference tensor, as the model's outputs are
    def replay() -> None:
        out.copy_(fn())

    return replay, out


@dataclass
class GraphStats:
    """captures: graphs captured; replays: steps replayed from one; eager: decode-only steps
    that ran eagerly (a shape or feature the graphs do not cover); failures: captures that
    raised (that shape then runs eagerly)."""

    captures: int = 0
    replays: int = 0
    eager: int = 0
    failures: int = 0


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, None when n is above them all."""
    return next((s for s in sizes if s >= n), None)


def width_buckets(max_blocks: int) -> tuple[int, ...]:
    """Powers of two from MIN_WIDTH_BLOCKS, the last one max_blocks itself."""
    sizes, w = [], MIN_WIDTH_BLOCKS
    while w < max_blocks:
        sizes.append(w)
        w *= 2
    return (*sizes, max_blocks)


class _Graph:
    """One captured shape: rows B, block-table width W, with or without the LoRA launches.
    Holds the fixed input buffers the forward reads and the logits it writes."""

    def __init__(self, owner: DecodeGraphs, rows: int, width: int, lora: bool) -> None:
        dev = owner.device
        self.rows, self.width = rows, width
        self.ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.attention = owner.buffers(rows, width, owner.block_size, dev)
        sample = torch.arange(rows, device=dev)
        self.groups: dict[str, SgmvWeights] = {}
        lora_meta = None
        if lora:
            for g, h_out in owner.h_out.items():
                self.groups[g] = _static_weights(rows, h_out, owner.max_rank * len(h_out), dev)
            width_v = max(w.max_rank for w in self.groups.values())
            workspace = torch.zeros(rows, width_v, dtype=torch.float32, device=dev)
            lora_meta = LoraBatchMeta(self.groups, workspace)
        self.batch = Batch(self.ids, self.positions, self.attention.meta, lora_meta, sample)
        model, kv, sgmv = owner.model, owner.kv, owner.sgmv

        def forward() -> torch.Tensor:
            self.attention.prepare()
            return model(self.batch, kv, sgmv)

        self.forward = forward
        self.replay: Callable[[], object] | None = None
        self.logits: torch.Tensor | None = None

    def load(self, batch: Batch, row_segment: torch.Tensor | None) -> None:
        """Copy a decode-only batch of T <= rows rows into the buffers (rows past T repeat
        row T - 1); row_segment: [rows] int64, each row's segment in batch.lora's tables."""
        t = batch.input_ids.shape[0]
        put(self.ids, batch.input_ids, t)
        put(self.positions, batch.positions, t)
        self.attention.load(batch.attention, t)
        given = batch.lora.groups if batch.lora is not None else {}
        for g, static in self.groups.items():
            w_g = given.get(g)
            if w_g is None:
                static.a_ptr.zero_()
                static.b_ptr.zero_()
                static.ranks.zero_()
                continue
            torch.index_select(w_g.a_ptr, 0, row_segment, out=static.a_ptr)
            torch.index_select(w_g.b_ptr, 0, row_segment, out=static.b_ptr)
            torch.index_select(w_g.ranks, 0, row_segment, out=static.ranks)


def _static_weights(rows: int, h_out: tuple[int, ...], max_rank: int, dev) -> SgmvWeights:
    """One one-row segment per row, every pointer 0 (no adapter) until load() fills them."""
    n = len(h_out)
    return SgmvWeights(
        seg=torch.arange(rows + 1, dtype=torch.int32, device=dev),
        seg_host=tuple(range(rows + 1)),
        ranks=torch.zeros(rows, n, dtype=torch.int32, device=dev),
        ranks_host=((0,) * n,) * rows,
        a=(None,) * rows,
        b=(None,) * rows,
        a_ptr=torch.zeros(rows, dtype=torch.int64, device=dev),
        b_ptr=torch.zeros(rows, dtype=torch.int64, device=dev),
        h_out=h_out,
        max_rows=1,
        max_rank=max_rank,
        static=True,
    )


class DecodeGraphs:
    """The engine's decode graphs. run(batch) -> logits [T, vocab] from a graph, or None
    when the step must run eagerly. `enabled` turns replays off (and on) at run time."""

    def __init__(
        self,
        model,
        kv: torch.Tensor,
        sgmv,
        allocator,
        h_out: dict[str, tuple[int, ...]],
        block_size: int,
        max_model_len: int,
        max_batch_size: int,
        max_rank: int,
        device: torch.device,
        capture: Capture = cuda_capture,
        attention: str = "torch",
    ) -> None:
        """attention: the engine's attention backend (graph_attention.BUFFERS' names)."""
        self.model, self.kv, self.sgmv, self.allocator = model, kv, sgmv, allocator
        self.buffers = BUFFERS[attention]
        self.h_out, self.block_size, self.max_rank = h_out, block_size, max_rank
        self.device, self.capture = device, capture
        top = bucket(max_batch_size, BATCH_BUCKETS) or BATCH_BUCKETS[-1]
        self.batch_sizes = tuple(b for b in BATCH_BUCKETS if b <= top)
        self.widths = width_buckets(-(-max_model_len // block_size))
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.graphs: dict[tuple[int, int, bool], _Graph | None] = {}
        self.stats = GraphStats()
        self.enabled = True
        # LoRA steps replay only on a backend that reads the fixed weights' tensors
        self.lora_graphs = bool(getattr(sgmv, "graph_safe", False))
        if not self.lora_graphs:
            log.info(
                "CUDA graphs: steps with adapters run eagerly (the %s SGMV backend picks "
                "adapters on the host, which a graph would freeze)",
                getattr(sgmv, "name", type(sgmv).__name__),
            )

    def capture_start(self) -> None:
        """Every batch bucket at the smallest width, with and without LoRA (logged)."""
        t0 = time.perf_counter()
        for rows in self.batch_sizes:
            for lora in (False, True) if self.lora_graphs else (False,):
                self._graph(rows, self.widths[0], lora)
        log.info(
            "CUDA graphs: %d decode graphs captured in %.1f s (batch sizes %s, block-table "
            "width %d; wider tables captured on first use)",
            self.stats.captures,
            time.perf_counter() - t0,
            ",".join(map(str, self.batch_sizes)),
            self.widths[0],
        )

    def choose(self, batch: Batch) -> _Graph | None | bool:
        """The graph `batch` replays (captured now if new); None when it is a decode-only
        step that runs eagerly, False when it is no graph's to run (not decode-only, or
        graphs off). An overlapped step chooses on the host's thread and replays on the
        device's (replay), so no capture meets the host's own launches."""
        if not self.enabled or not _decode_only(batch, self.buffers):
            return False
        key = self._key(batch)
        return None if key is None else self._graph(*key)

    def run(self, batch: Batch) -> torch.Tensor | None:
        """The batch's logits [T, vocab] from its graph, or None when it runs eagerly."""
        return self.replay(self.choose(batch), batch)

    def replay(self, graph: _Graph | None | bool, batch: Batch) -> torch.Tensor | None:
        """The logits of `batch` from `graph` (choose's answer for it); None: run it
        eagerly."""
        if graph is False:
            return None
        if graph is None:
            self.stats.eager += 1
            return None
        t = batch.input_ids.shape[0]
        graph.load(batch, self._row_segments(batch, graph.rows) if graph.groups else None)
        graph.replay()
        self.stats.replays += 1
        return graph.logits[:t]

    def _key(self, batch: Batch) -> tuple[int, int, bool] | None:
        rows = bucket(batch.input_ids.shape[0], self.batch_sizes)
        width = bucket(self.buffers.width(batch.attention), self.widths)
        lora = batch.lora
        if rows is None or width is None:
            return None
        if lora is not None:
            if not self.lora_graphs:
                return None
            if lora.embed or lora.head or set(lora.groups) - set(self.h_out):
                return None
            if any(w.max_rank > self.max_rank * len(w.h_out) for w in lora.groups.values()):
                return None
        return rows, width, lora is not None

    def _row_segments(self, batch: Batch, rows: int) -> torch.Tensor:
        """[rows] int64 on the device: the segment of each row (padding: the last row's)."""
        seg = next(iter(batch.lora.groups.values())).seg_host
        index = [s for s in range(len(seg) - 1) for _ in range(seg[s + 1] - seg[s])]
        index += [index[-1]] * (rows - len(index))
        return torch.tensor(index, dtype=torch.int64).to(self.device, non_blocking=True)

    def _graph(self, rows: int, width: int, lora: bool) -> _Graph | None:
        key = (rows, width, lora)
        if key in self.graphs:
            return self.graphs[key]
        if len(self.graphs) >= MAX_GRAPHS:
            return None
        scratch = self.allocator.allocate(1)  # the warm-up run writes its K/V there
        if scratch is None:
            return None  # not remembered: tried again when a block is free
        try:
            self.graphs[key] = graph = self._capture(rows, width, lora, scratch[0])
        finally:
            self.allocator.free(scratch)
        return graph

    def _capture(self, rows: int, width: int, lora: bool, scratch: int) -> _Graph | None:
        """A new graph, every row of its warm-up and capture pointing at block `scratch`;
        None (that shape then runs eagerly) when the capture raised."""
        t0 = time.perf_counter()
        try:
            graph = _Graph(self, rows, width, lora)
            graph.attention.point_at(scratch)
            graph.replay, graph.logits = self.capture(graph.forward, self.pool, self.device)
        except Exception as exc:  # noqa: BLE001 - this shape runs eagerly instead
            self.stats.failures += 1
            log.warning(
                "CUDA graph for %d rows x %d blocks (lora=%s) failed: %r; that shape runs eagerly",
                rows,
                width,
                lora,
                exc,
            )
            return None
        self.stats.captures += 1
        log.debug(
            "CUDA graph: %d rows x %d blocks (lora=%s) in %.3f s",
            rows,
            width,
            lora,
            time.perf_counter() - t0,
        )
        return graph


def _decode_only(batch: Batch, buffers=TorchDecodeBuffers) -> bool:
    """Every row a decode in the plan of the graphs' attention backend, every row sampled."""
    rows = batch.input_ids.shape[0]
    return (
        rows > 0
        and buffers.covers(batch.attention, rows)
        and batch.logit_rows is None
        and batch.sample_rows.shape[0] == rows
    )
