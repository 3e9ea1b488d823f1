"""Builds one step's Batch: rows grouped by adapter, attention and SGMV metadata planned once.

Rows of a request are contiguous; requests sharing an adapter version are adjacent, so each
adapter forms one SGMV segment whatever mix of prefill chunks and decodes it has."""

from __future__ import annotations

from typing import NamedTuple

import torch

from punica_x.attention.dist import DistContext, DistSeq, plan_dist
from punica_x.attention.paged import SeqSpan
from punica_x.core import Batch, LoraBatchMeta, Request
from punica_x.lora.adapter import GROUPS, LoraTarget
from punica_x.ops.sgmv import SgmvWeights


class ScheduledRequest(NamedTuple):
    """One request's part of a step: num_new_tokens tokens from its num_computed_tokens on
    (a NamedTuple: millions are made a simulated hour, and a frozen dataclass's init is 3x
    slower)."""

    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token (so it samples)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


def _edges(seg: list[int], refs: list, group: str) -> tuple:
    """(first row, end row, A^T, B^T) of each segment whose adapter has LoRA on `group`
    ("embed": the embedding, "head": the LM head)."""
    out = []
    for i, ref in enumerate(refs):
        w = ref.weights if ref is not None else None
        if w is not None and group in w.groups:
            out.append((seg[i], seg[i + 1], *w.groups[group]))
    return tuple(out)


def _adapter_key(s: ScheduledRequest) -> int:
    return s.request.adapter.version if s.request.adapter is not None else 0


class BatchPlanner:
    def __init__(
        self, target: LoraTarget, block_size: int, device: torch.device, attention
    ) -> None:
        self.attention = attention
        self.dist: DistContext | None = None  # set when the runner takes part in DistKV
        self.block_size = block_size
        self.device = device
        shapes = target.shapes
        self.h_out = {g: tuple(shapes[m][1] for m in mods) for g, mods in GROUPS.items()}

    def plan(self, scheduled: list[ScheduledRequest]) -> tuple[Batch, list[ScheduledRequest]]:
        """Returns the batch and the scheduled requests in row order."""
        ordered = sorted(scheduled, key=_adapter_key)
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        dist: list[DistSeq] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_targets: list[tuple[Request, tuple[int, ...]]] = []
        for s in ordered:
            r, start = s.request, s.request.num_computed_tokens
            row = len(ids)
            ids.extend(r.all_token_ids[start : start + s.num_new_tokens])
            positions.extend(range(start, start + s.num_new_tokens))
            end = start + s.num_new_tokens
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
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            attention=attention,
            lora=self._plan_lora(ordered, len(ids)),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            logit_rows=(
                torch.tensor(sample_rows + prompt_rows, dtype=torch.int64, device=dev)
                if prompt_rows
                else None
            ),
            prompt_targets=tuple(prompt_targets),
        )
        return batch, ordered

    def _plan_lora(self, ordered: list[ScheduledRequest], rows: int) -> LoraBatchMeta | None:
        # One segment per run of requests with the same adapter version (0: base model).
        seg: list[int] = []
        refs: list = []
        keys: list[int] = []
        row = 0
        for s in ordered:
            key = _adapter_key(s)
            if not keys or keys[-1] != key:
                seg.append(row)
                keys.append(key)
                refs.append(s.request.adapter)
            row += s.num_new_tokens
        if all(ref is None for ref in refs):
            return None
        seg.append(rows)
        groups: dict[str, SgmvWeights] = {}
        for g, h_out in self.h_out.items():
            a, b, ranks = [], [], []
            for ref in refs:
                w = ref.weights if ref is not None else None
                has = w is not None and g in w.groups
                a.append(w.groups[g][0] if has else None)
                b.append(w.groups[g][1] if has else None)
                ranks.append(w.ranks[g] if has else (0,) * len(h_out))
            if any(x is not None for x in a):
                groups[g] = SgmvWeights.build(seg, a, b, ranks, h_out, self.device)
        width = max((w.max_rank for w in groups.values()), default=1)
        # [T, max rank sum]: shrink output, consumed by the expand of the same projection
        workspace = torch.empty(rows, width, dtype=torch.float32, device=self.device)
        return LoraBatchMeta(
            groups, workspace, _edges(seg, refs, "embed"), _edges(seg, refs, "head")
        )
