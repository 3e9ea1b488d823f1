"""Model-attention disaggregation (Lamina, seed 003 sec. 4), the model worker's side: the
attention of every layer runs on attention workers (punica_x/kv/attention_worker.py), each
holding a slice of the KV heads of every block, and this runner holds no KV.

Per step, plan() sends each worker one MicroPlan: the step's spans (SeqSpan: every request's
rows and block table, the model worker's block ids) and the slot of every new token. Per
layer, write_kv() keeps the new K/V and attend() sends each worker its heads' query rows and
K/V, all workers at once, and gathers their outputs in head order: out [T, H_q, D] and lse
[T, H_q] are the concatenation of the slices, with no merge (a head's attention is computed
whole on one worker), so the result is the plain backend's, row for row and head for head.

A worker is any KVPeer (prepare(debtor, plan) -> MicroAttention): an AttentionWorker in this
process, or a KVChannel to one in another process or node (the DistKV data plane)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from punica_x.attention.paged import SeqSpan
from punica_x.kv.attention_worker import HeadSlice
from punica_x.kv.rmanager import KVPeer, MicroPlan


@dataclass(frozen=True)
class WorkerRef:
    """An attention worker as the model worker reaches it: its peer and its head slice."""

    peer: KVPeer
    heads: HeadSlice


def step_plan(spans: list[SeqSpan], block_size: int, tables=None) -> MicroPlan:
    """The MicroPlan every worker gets for a step: the spans and, in row order, the block
    and offset of each row's new K/V (a span's rows are the last num_rows of kv_len);
    tables: MicroPlan.tables (None: unchanged since the last plan)."""
    blocks: list[int] = []
    offsets: list[int] = []
    for sp in sorted(spans, key=lambda s: s.row_start):
        for pos in range(sp.kv_len - sp.num_rows, sp.kv_len):
            blocks.append(sp.block_ids[pos // block_size])
            offsets.append(pos % block_size)
    return MicroPlan((), tuple(spans), tuple(blocks), tuple(offsets), tables)


class HeadSplitAttention:
    """The attention "backend" of a model worker: plans go to the workers (module doc).
    runner_id names this model worker to them; pool runs the workers' calls concurrently
    (None: a thread pool of one thread per worker, made here). tables: returns the block
    tables of every request holding blocks (MicroPlan.tables), sent with a plan when they
    changed, so that the workers can give a dead model worker's KV to its successor (None:
    never sent)."""

    name = "lamina"

    def __init__(
        self,
        workers: list[WorkerRef],
        runner_id: str,
        pool: Executor | None = None,
        tables: Callable[[], tuple] | None = None,
    ) -> None:
        if not workers:
            raise ValueError("HeadSplitAttention needs at least one attention worker")
        self.workers = list(workers)
        self.runner_id = runner_id
        self.tables = tables
        self._sent_tables: tuple | None = None
        self.pool = pool or ThreadPoolExecutor(len(workers), thread_name_prefix="lamina")
        # layers' attention calls sent to the workers and their wall time in the step's
        # thread (attention on the workers plus the exchange): counters for benchmarks
        self.calls = 0
        self.seconds = 0.0

    def plan(self, spans: list[SeqSpan], block_size: int, device: torch.device) -> HeadSplitPlan:
        plan = step_plan(spans, block_size, self._changed_tables())
        try:
            steps = self._each(lambda i, w: w.peer.prepare(self.runner_id, plan))
        except Exception:
            self.forget_tables()
            raise
        rows = sum(sp.num_rows for sp in spans)
        return HeadSplitPlan(self, steps, rows)

    def _changed_tables(self) -> tuple | None:
        """The block tables when they differ from those last sent, else None."""
        if self.tables is None:
            return None
        tables = self.tables()
        if tables == self._sent_tables:
            return None
        self._sent_tables = tables
        return tables

    def forget_tables(self) -> None:
        """Send the tables with the next plan whatever they are (a worker was replaced, or a
        plan failed: what the workers kept is unknown)."""
        self._sent_tables = None

    def _each(self, fn) -> list:
        """fn(index, worker) for every worker, concurrently; the results in worker order (the
        first failure raised after all have finished)."""
        if len(self.workers) == 1:
            return [fn(0, self.workers[0])]
        futures = [self.pool.submit(fn, i, w) for i, w in enumerate(self.workers)]
        errors = [f.exception() for f in futures]
        for exc in errors:
            if exc is not None:
                raise exc
        return [f.result() for f in futures]


class HeadSplitPlan:
    """One step's attention on the workers: write_kv(k, v) keeps the layer's new K/V,
    attend(q) sends each worker its slice and concatenates the replies."""

    fuses_rope = False

    def __init__(self, backend: HeadSplitAttention, steps: list, rows: int) -> None:
        self.backend, self.steps, self.rows = backend, steps, rows
        self._kv: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def write_kv(self, kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, N_kv, D]: sent with the layer's attend() (kv, this runner's, is unused)."""
        self._kv = (layer, k, v)

    def attend(self, q, kv, layer: int, scale: float, window: int = 0, softcap: float = 0.0):
        """q [T, H_q, D] -> (out [T, H_q, D], lse [T, H_q] float32) from the workers. window
        and softcap are not sent: each worker holds the model's, per layer (WorkerSpec)."""
        held, self._kv = self._kv, None
        if held is None or held[0] != layer:
            raise RuntimeError(f"attend() of layer {layer} without its write_kv()")
        _, k, v = held

        def call(i: int, w: WorkerRef):
            qs, ks, vs = q[:, w.heads.q_heads()], k[:, w.heads.kv_heads()], v[:, w.heads.kv_heads()]
            return self.steps[i].run(
                layer, qs.contiguous(), ks.contiguous(), vs.contiguous(), scale
            )

        t0 = time.perf_counter()
        parts = self.backend._each(call)
        self.backend.calls += 1
        self.backend.seconds += time.perf_counter() - t0
        if len(parts) == 1:
            return parts[0]
        out = torch.cat([o.to(q.dtype) for o, _ in parts], dim=1)
        lse = torch.cat([s for _, s in parts], dim=1)
        return out, lse
