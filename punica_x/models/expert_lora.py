"""LoRA on a mixture of experts for one layer of one step (models/moe.py calls it).

The MoE block sorts the step's (row, expert) pairs by expert, each expert's rows in step
order; the batch's rows come grouped by adapter, so within an expert the rows of one adapter
are consecutive too. Each (adapter, expert) run of pairs is one SGMV segment whose weights
are that adapter's LoRA for that expert (a[e] [L, r, in] and b[e] [L, r * out]:
lora/expert_layout.py), and one launch per projection (gate|up, down) adds all of them.
The segments are planned once per layer (the routing differs by layer) and serve both
projections; the router's own LoRA (PEFT's on mlp.gate.weight) is added to its logits."""

from __future__ import annotations

import torch

from punica_x.ops.per_row import products
from punica_x.ops.sgmv import add_lora_sgmv
from punica_x.ops.sgmv_weights import SgmvWeights

Runs = tuple[tuple[int, int, dict], ...]  # LoraBatchMeta.experts


def add_router_lora(
    logits: torch.Tensor, x: torch.Tensor, runs: Runs, layer: int, fixed_order: bool = False
) -> None:
    """logits [T, E] float32 += (x @ A^T) @ B^T (scaled) on the rows of each run whose adapter
    has LoRA on the router, in float32; fixed_order (the batch-invariant mode): a row at a
    time."""
    for lo, hi, groups in runs:
        router = groups.get("gate")
        if router is not None:
            a, b = router  # [L, r, hidden], [L, r, E]
            mats = [a[layer].float().t(), b[layer].float()]
            logits[lo:hi] += products(x[lo:hi].float(), mats, fixed_order)


class ExpertSegments:
    """The (adapter, expert) segments of one layer's sorted pairs.

    rows: [N] the step row of each sorted pair; counts: pairs per expert (E entries); runs:
    the step's (first row, end row, expert groups) of adapters with expert LoRA; t: the
    step's row count."""

    def __init__(self, rows: torch.Tensor, counts: list[int], runs: Runs, t: int) -> None:
        self.runs = runs
        active = [e for e, n in enumerate(counts) if n]
        experts = torch.repeat_interleave(
            torch.arange(len(counts), device=rows.device), torch.tensor(counts, device=rows.device)
        )
        keys = experts * t + rows  # ascending: by expert, then row
        bounds = torch.tensor(
            [[e * t + lo, e * t + hi] for e in active for lo, hi, _ in runs],
            dtype=torch.int64,
            device=rows.device,
        )
        at = torch.searchsorted(keys, bounds).tolist()
        # (first pair, end pair, run, expert) of every non-empty (adapter, expert) run
        self.spans = [
            (s0, s1, i % len(runs), active[i // len(runs)])
            for i, (s0, s1) in enumerate(at)
            if s1 > s0
        ]
        self.num_pairs = rows.shape[0]

    def add(self, y: torch.Tensor, x: torch.Tensor, module: str, layer: int, backend) -> None:
        """y [N, out] += each segment's x [N, in] @ A_e^T @ B_e^T for `module`
        ("experts.gate_up_proj" or "experts.down_proj"), in place."""
        weights = self._weights(module, y.shape[1], y.device)
        if weights is None:
            return
        v = torch.empty(self.num_pairs, weights.max_rank, dtype=torch.float32, device=y.device)
        if backend is None:
            add_lora_sgmv(y, x, weights, layer, v)
        else:
            backend.add_lora(y, x, v, weights, layer)

    def _weights(self, module: str, h_out: int, device) -> SgmvWeights | None:
        seg, a, b, ranks = [0], [], [], []
        for s0, s1, run, expert in self.spans:
            group = self.runs[run][2].get(module)
            if group is None:
                continue
            if s0 > seg[-1]:  # pairs of no adapter with this module: a gap
                seg.append(s0)
                a.append(None), b.append(None), ranks.append((0,))
            seg.append(s1)
            a.append(group[0][expert])
            b.append(group[1][expert])
            ranks.append((group[0].shape[2],))
        if not a:
            return None
        if seg[-1] < self.num_pairs:
            seg.append(self.num_pairs)
            a.append(None), b.append(None), ranks.append((0,))
        return SgmvWeights.build(seg, a, b, ranks, (h_out,), device)
