"""Builds one step's Batch: rows grouped by adapter, attention and SGMV metadata planned once.

Rows of a request are contiguous; requests sharing an adapter version are adjacent, so each
adapter forms one SGMV segment whatever mix of prefill chunks and decodes it has. A decode
step of the requests of the step before is planned from that step's tensors by deltas
(batching/persistent.py) where the attention backend has a decode_plan."""

from __future__ import annotations

import torch

from punica_x.attention.dist import DistContext, DistSeq, plan_dist
from punica_x.attention.paged import SeqSpan
from punica_x.batching.lora_plan import LoraPlanner
from punica_x.batching.persistent import DecodeRows
from punica_x.batching.schedule import ScheduledRequest
from punica_x.host_ints import int64
from punica_x.lora.adapter import GROUPS, LoraTarget
from punica_x.runtime import Batch, InputFills, LoraBatchMeta, Request


def _adapter_key(s: ScheduledRequest) -> int:
    return s.request.adapter.version if s.request.adapter is not None else 0


def _append_inputs(
    ids: list[int], fills: list[tuple[int, int]], r: Request, start: int, n: int
) -> None:
    """r's input tokens [start, start + n) onto ids; a last one still in flight (overlapped
    steps) as a placeholder the device fills from the previous step's samples (fills)."""
    if n == 1:  # a decode row: no copy of the request's tokens
        k, out = start - len(r.prompt_token_ids), r.output_token_ids
        if k < 0:
            ids.append(r.prompt_token_ids[start])
            return
        if k < len(out):
            ids.append(out[k])
            return
    else:
        ids.extend(r.all_token_ids[start : start + n])
        if r.num_known_tokens - start >= n:
            return
    fills.append((len(ids), r.inflight_row))
    ids.append(0)


class BatchPlanner:
    def __init__(
        self,
        target: LoraTarget,
        block_size: int,
        device: torch.device,
        attention,
        keep_rows: bool = True,
    ) -> None:
        """keep_rows: plan decode steps from the last step's rows (batching/persistent.py)
        where the attention backend can; False where a request may get new blocks at the
        same length (KV swapped to the host and back: MLFQ)."""
        self.attention = attention
        self.dist: DistContext | None = None  # set when the runner takes part in DistKV
        self.block_size = block_size
        self.device = device
        shapes = target.shapes
        # a projection the model offers no adapter (a mixture of experts' MLP): width 0
        h_out = {g: tuple(shapes.get(m, (0, 0))[1] for m in mods) for g, mods in GROUPS.items()}
        self.lora = LoraPlanner(h_out, device)
        # the last step's rows, for a decode step planned by deltas (None: the backend plans
        # every step from spans)
        self.rows = None
        self._last_lora: LoraBatchMeta | None = None
        if keep_rows and hasattr(attention, "decode_plan"):
            self.rows = DecodeRows(block_size, attention, device)

    def plan(self, scheduled: list[ScheduledRequest]) -> tuple[Batch, list[ScheduledRequest]]:
        """Returns the batch and the scheduled requests in row order."""
        ordered = sorted(scheduled, key=_adapter_key)
        kept = self.rows if self.dist is None else None
        step = kept.advance(ordered) if kept is not None else None
        if step is not None:
            dev = self.device
            rows = torch.arange(len(ordered), dtype=torch.int64, device=dev)
            batch = Batch(
                input_ids=step.input_ids.to(dev),
                positions=step.positions.to(dev),
                attention=step.attention,
                lora=self._last_lora if step.same_rows else self._plan_lora(ordered, len(ordered)),
                sample_rows=rows,
                input_fills=step.fills,
            )
            return batch, ordered
        batch, kv_lens = self._plan_spans(ordered)
        if kept is not None:
            kept.keep([s.request for s in ordered], kv_lens)
        return batch, ordered

    def _plan_spans(self, ordered: list[ScheduledRequest]) -> tuple[Batch, list[int]]:
        """The batch of `ordered` from each request's span of rows (any mix of rows), and
        each request's KV length after it."""
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        dist: list[DistSeq] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[tuple[Request, tuple[int, ...]]] = []
        fills: list[tuple[int, int]] = []
        kv_lens: list[int] = []
        for s in ordered:
            r, start = s.request, s.request.num_computed_tokens
            row = len(ids)
            _append_inputs(ids, fills, r, start, s.num_new_tokens)
            positions.extend(range(start, start + s.num_new_tokens))
            end = start + s.num_new_tokens
            kv_lens.append(end)
            if r.remote:
                remote = tuple(r.remote)
                dist.append(DistSeq(row, s.num_new_tokens, end, r.block_ids, remote, r.request_id))
            else:
                spans.append(SeqSpan(row, s.num_new_tokens, end, r.block_ids))
            if s.samples:
                sample_rows.append(len(ids) - 1)
            if r.sampling.prompt_logprobs is not None:
                # the row at position p scores prompt token p + 1; tokens scored before a
                # preemption are not scored again
                first = max(start + 1, len(r.prompt_logprobs), 1)
                last = min(start + s.num_new_tokens, len(r.prompt_token_ids) - 1)
                if first <= last:
                    prompt_rows.extend(row + t - 1 - start for t in range(first, last + 1))
                    prompt_targets.append((r, tuple(range(first, last + 1))))
        dev = self.device
        if dist:
            attention = plan_dist(
                self.attention, spans, dist, len(ids), self.block_size, dev, self.dist
            )
        else:
            attention = self.attention.plan(spans, self.block_size, dev)
        batch = Batch(
            input_ids=int64(ids).to(dev),
            positions=int64(positions).to(dev),
            attention=attention,
            lora=self._plan_lora(ordered, len(ids)),
            sample_rows=int64(sample_rows).to(dev),
            logit_rows=int64(sample_rows + prompt_rows).to(dev) if prompt_rows else None,
            prompt_targets=tuple(prompt_targets),
            input_fills=InputFills.of(fills),
        )
        return batch, kv_lens

    def _plan_lora(self, ordered: list[ScheduledRequest], rows: int) -> LoraBatchMeta | None:
        """One segment per run of requests with the same adapter version (0: base model);
        kept as _last_lora (a decode step of the same rows takes it as it is)."""
        self._last_lora = self._lora_of(ordered, rows)
        return self._last_lora

    def _lora_of(self, ordered: list[ScheduledRequest], rows: int) -> LoraBatchMeta | None:
        seg: list[int] = []
        weights: list = []
        keys: list[int] = []
        row = 0
        for s in ordered:
            key = _adapter_key(s)
            if not keys or keys[-1] != key:
                seg.append(row)
                keys.append(key)
                ref = s.request.adapter
                weights.append(ref.weights if ref is not None else None)
            row += s.num_new_tokens
        seg.append(rows)
        return self.lora.plan(seg, weights)

    def forget(self) -> None:
        """Drop what is kept between steps (the last LoRA plan: lora_plan.LoraPlanner; the
        last step's rows: persistent.DecodeRows)."""
        self.lora.forget()
        self._last_lora = None
        if self.rows is not None:
            self.rows.forget()
