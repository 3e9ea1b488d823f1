"""A mixture-of-experts MLP block (Qwen2/3-MoE, Mixtral, OLMoE; the spec: moe_spec.py).

Per layer and step, for the step's T rows x [T, hidden]:

1. route: the router's logits [T, E] (a dense GEMM), a float32 softmax, the top k
   probabilities of each row as its weights [T, k] (normalized to sum 1 where the family
   does), and its experts [T, k];
2. group: the T * k (row, expert) pairs sorted by expert once (a stable sort, so each
   expert's rows keep the step's order, and with it the rows of one adapter stay together);
3. one dense GEMM pair per active expert over its rows (gate|up, act-and-mul, down): only
   the routed experts' weights are read, as the model's dense backend holds them;
4. each pair's output times its weight, summed into its row (index_add).

A shared expert (Qwen2-MoE) runs for every row, weighted by sigmoid(x @ shared_gate^T).
The routing is computed anew every step and layer, never cached.

Batch-invariant (`fixed_order`, ops.invariance): the GEMMs are the mode's dense backend's and
the expert LoRA its SGMV's; the router's LoRA products and the shared expert's [rows, 1]
sigmoid run a row at a time (ops.per_row); the softmax and top-k are per row, and a row's k
weighted outputs are added in expert order whatever the other rows."""

from __future__ import annotations

import torch
from torch import nn

from punica_x.layers.linear import Dense
from punica_x.models.dims import ACTIVATIONS, LlamaDims
from punica_x.models.expert_lora import ExpertSegments, add_router_lora
from punica_x.ops.per_row import rows as per_row


class MoeBlock(nn.Module):
    """The experts of one sparse layer. gate: the router ([E, hidden]); experts_gate_up[e]
    ([2 I, hidden], gate then up) and experts_down[e] ([hidden, I]): expert e; shared_gate_up,
    shared_down, shared_expert_gate ([1, hidden]): the shared expert, where the spec has one."""

    def __init__(self, d: LlamaDims, dtype: torch.dtype, device) -> None:
        super().__init__()
        spec = d.moe
        h, i, e = d.hidden_size, spec.expert_size, spec.num_experts
        self.num_experts, self.top_k = e, spec.top_k
        self.norm_topk, self.float_weights = spec.norm_topk, spec.float_weights
        self.gate = Dense(h, (e,), False, dtype, device)
        self.experts_gate_up = nn.ModuleList(
            Dense(h, (i, i), False, dtype, device) for _ in range(e)
        )
        self.experts_down = nn.ModuleList(Dense(i, (h,), False, dtype, device) for _ in range(e))
        self.act_and_mul = ACTIVATIONS[d.activation]  # the fused layers' method
        self.shared_gate_up = self.shared_down = self.shared_expert_gate = None
        self.fixed_order = False  # the batch-invariant mode (LlamaForCausalLM.hold_fixed_order)
        if spec.shared_size:
            s = spec.shared_size
            self.shared_gate_up = Dense(h, (s, s), False, dtype, device)
            self.shared_down = Dense(s, (h,), False, dtype, device)
            self.shared_expert_gate = Dense(h, (1,), False, dtype, device)

    def experts(self) -> list[Dense]:
        """Every expert's GEMMs, the shared expert's included (not the router's)."""
        shared = [self.shared_gate_up, self.shared_down]
        return [*self.experts_gate_up, *self.experts_down, *(m for m in shared if m is not None)]

    def forward(self, x: torch.Tensor, batch, layer: int, backend, fused) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden], the block's output for every row; the LoRA of the
        rows' adapters on the router and the experts (batch.lora.experts) added at `layer`
        through the SGMV `backend` (None: the reference)."""
        runs = batch.lora.experts if batch.lora is not None else ()
        logits = self.gate.dense(x).float()
        if runs:
            add_router_lora(logits, x, runs, layer, self.fixed_order)
        weights, experts = route(logits, self.top_k, self.norm_topk)
        if not self.float_weights:
            weights = weights.to(x.dtype)
        rows, counts, order = group_by_expert(experts, self.num_experts)
        xs = x.index_select(0, rows)  # [T * k, hidden], each expert's rows together
        segments = ExpertSegments(rows, counts, runs, x.shape[0]) if runs else None
        gate_up = _per_expert(self.experts_gate_up, xs, counts)  # [T * k, 2 I]
        if segments is not None:
            segments.add(gate_up, xs, "experts.gate_up_proj", layer, backend)
        act = getattr(fused, self.act_and_mul)
        h = act(gate_up)
        ys = _per_expert(self.experts_down, h, counts)  # [T * k, hidden]
        if segments is not None:
            segments.add(ys, h, "experts.down_proj", layer, backend)
        ys = ys * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        out = torch.zeros_like(x).index_add_(0, rows, ys.to(x.dtype))
        if self.shared_gate_up is not None:
            shared = self.shared_down.dense(act(self.shared_gate_up.dense(x)))
            gate = per_row(torch.sigmoid, self.shared_expert_gate.dense(x), self.fixed_order)
            out += gate * shared
        return out


def _per_expert(dense: nn.ModuleList, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each active expert's GEMM over its consecutive rows of xs, concatenated ([N, out]):
    only the routed experts' weights are read."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(dense[e].dense(xs[start : start + n]))
            start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], experts int64 [T, k]): the k largest of
    softmax(logits) in float32 per row, divided by their sum when `normalize`, as HF's
    TopKRouter computes them."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def group_by_expert(experts: torch.Tensor, num_experts: int):
    """experts [T, k] -> (rows [T * k] int64, counts [E] list of ints, order [T * k]): the
    (row, expert) pairs sorted by expert, stably (each expert's rows in step order): pair j
    is row rows[j] at flattened index order[j]; expert e holds counts[e] consecutive pairs."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = torch.div(order, experts.shape[1], rounding_mode="floor")
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return rows, counts, order
