"""Batched Llama-family decoder over a paged KV cache: Llama, SmolLM and Mistral as they are,
and every family of the registry (punica_x/models/registry.py: Qwen2/3, Phi-3, Gemma 2/3)
with what its Family declares (biases, per-head q/k norms, fused checkpoints, Gemma's norms,
activation, scaling and soft-capping) and its config says (sliding windows per layer).

All rows of a step (prefill chunks and decodes of many requests, grouped by adapter) go
through ONE invocation: dense projections see one [T, hidden] matrix, LoRA add-ons use the
step's SGMV metadata, attention reads each sequence's blocks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from punica_x.layers.linear import Dense, LoraLinear
from punica_x.layers.norm import RMSNorm
from punica_x.layers.rope import RotaryEmbedding
from punica_x.models.dims import ACTIVATIONS, LlamaDims  # noqa: F401  (LlamaDims: re-exported)
from punica_x.models.moe import MoeBlock
from punica_x.models.registry import SUPPORTED_ARCHITECTURES  # noqa: F401
from punica_x.ops.dense import HEAD_ROWS, PROJECTION_ROWS, DenseBackend, has_rows
from punica_x.ops.per_row import products
from punica_x.ops.sgmv import SgmvBackend
from punica_x.runtime import Batch

# dense(n, k, rows) -> the backend for an [n, k] weight that sees x of about `rows` rows
DenseChooser = Callable[[int, int, tuple[int, ...]], DenseBackend]

# quant(format, n, k, rows) -> the dense backend for an [n, k] weight in that block format
# that sees x of about `rows` rows (ops.quant_dense.choose_quant)
QuantChooser = Callable[[str, int, int, tuple[int, ...]], DenseBackend]


class LlamaAttention(nn.Module):
    def __init__(self, d: LlamaDims, layer: int, dtype, device) -> None:
        super().__init__()
        self.window = d.layer_windows[layer] if d.layer_windows else 0
        self.softcap = d.attn_softcap
        self.num_heads, self.num_kv_heads, self.head_dim = d.num_heads, d.num_kv_heads, d.head_dim
        q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
        self.qkv_proj = LoraLinear(
            d.hidden_size, (q, kv, kv), "qkv", d.attention_bias, dtype, device
        )
        self.o_proj = LoraLinear(q, (d.hidden_size,), "o", d.o_bias, dtype, device)
        self.scale = d.attn_scale or d.head_dim**-0.5
        self.q_norm = self.k_norm = None
        self.norm_heads = d.qk_norm  # over each head's head_dim values, else the whole q / k
        if d.qk_norm or d.qk_norm_full:
            width = (d.head_dim,) * 2 if d.qk_norm else (q, kv)
            self.q_norm = RMSNorm(width[0], d.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(width[1], d.rms_norm_eps, dtype, device)

    def forward(
        self,
        x,
        batch: Batch,
        layer: int,
        kv: torch.Tensor,
        rope: RotaryEmbedding,
        backend: SgmvBackend | None,
        fused,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x, batch.lora, layer, backend)  # [T, (H_q + 2 N_kv) D]
        plan = batch.attention
        if self.q_norm is None and fused.name == "cpu" and getattr(plan, "fuses_rope", False):
            # RoPE, the KV write and attention in one native call (CpuAttentionPlan)
            args = (self.num_heads, batch.positions, *rope.tables(), self.scale)
            out = plan.rope_write_attend(qkv, kv, layer, *args, self.window, self.softcap)
            return self.o_proj.forward(out, batch.lora, layer, backend)
        q, k, v = qkv.split_with_sizes(self.qkv_proj.out_slices, dim=-1)
        if self.q_norm is not None and self.norm_heads:  # [T * heads, D] rows; [T, heads * D]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, -1)
        elif self.q_norm is not None:  # over all heads at once (OLMoE)
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        rope.rotate_(q, self.num_heads, batch.positions, fused)
        rope.rotate_(k, self.num_kv_heads, batch.positions, fused)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        batch.attention.write_kv(kv, layer, k, v)
        out, _ = batch.attention.attend(q, kv, layer, self.scale, self.window, self.softcap)
        return self.o_proj.forward(out.view(t, -1), batch.lora, layer, backend)


class LlamaMLP(nn.Module):
    def __init__(self, d: LlamaDims, dtype, device) -> None:
        super().__init__()
        i = d.intermediate_size
        self.gate_up_proj = LoraLinear(d.hidden_size, (i, i), "gate_up", d.mlp_bias, dtype, device)
        self.down_proj = LoraLinear(i, (d.hidden_size,), "down", d.mlp_bias, dtype, device)
        self.act_and_mul = ACTIVATIONS[d.activation]  # the fused layers' method

    def forward(
        self, x, batch: Batch, layer: int, backend: SgmvBackend | None, fused
    ) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x, batch.lora, layer, backend)  # [T, 2 I]
        act = getattr(fused, self.act_and_mul)(gate_up)
        return self.down_proj.forward(act, batch.lora, layer, backend)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: LlamaDims, layer: int, dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(d, layer, dtype, device)
        self.post_attention_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype, device)
        sparse = d.moe is not None and d.moe.sparse_layers[layer]
        self.mlp = MoeBlock(d, dtype, device) if sparse else LlamaMLP(d, dtype, device)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if d.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype, device)
            self.post_feedforward_layernorm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype, device)

    def forward(
        self, normed, residual, next_norm: RMSNorm, batch, layer, kv, rope, backend, fused
    ) -> torch.Tensor:
        """normed = input_layernorm(residual). Adds this layer's attention and MLP outputs to
        the residual stream in place; returns next_norm(residual) for what comes next.
        Sandwich norms (Gemma): each output is normed before it is added, and the MLP's
        input is pre_feedforward_layernorm(residual)."""
        attn = self.self_attn.forward(normed, batch, layer, kv, rope, backend, fused)
        if self.pre_feedforward_layernorm is None:
            normed = self.post_attention_layernorm.add(attn, residual)
            return next_norm.add(self.mlp.forward(normed, batch, layer, backend, fused), residual)
        normed = self.pre_feedforward_layernorm.add(self.post_attention_layernorm(attn), residual)
        mlp = self.post_feedforward_layernorm(self.mlp(normed, batch, layer, backend, fused))
        return next_norm.add(mlp, residual)


class LlamaForCausalLM(nn.Module):
    def __init__(self, d: LlamaDims, hf_config, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dims = d
        # no random init (the checkpoint's table replaces it; loader._check_complete makes
        # sure one came): 0.3 s of each load for a 49k x 576 table
        table = torch.empty(d.vocab_size, d.hidden_size, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding.from_pretrained(table, freeze=True)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(d, i, dtype, device) for i in range(d.num_layers)
        )
        self.norm = RMSNorm(d.hidden_size, d.rms_norm_eps, dtype, device)
        types = d.layer_types or ("all",) * d.num_layers  # one RoPE unless per layer type
        per_type = bool(d.layer_types)
        self.ropes = nn.ModuleDict(
            {
                t: RotaryEmbedding(
                    hf_config, d.head_dim, d.max_positions, dtype, device, t if per_type else None
                )
                for t in sorted(set(types))
            }
        )
        # each layer's RoPE (Gemma 3: local and global layers have their own base)
        self.layer_ropes = [self.ropes[t] for t in types]
        self.lm_head = Dense(d.hidden_size, (d.vocab_size,), False, dtype, device)
        self.embed_from_head = False  # tied: the embedding read from the head's layout
        # the batch-invariant mode (ops.invariance): the edge LoRA deltas a row at a time
        self.fixed_order = False  # set by hold_fixed_order
        # an untied embedding kept quantized: its rows are dequantized per step (rows())
        self.embed_table: Dense | None = None
        self.edge_digests: dict[str, str] = {}  # the loader's (lora.adapter.edge_digest)

    def hold_fixed_order(self, on: bool) -> None:
        """The batch-invariant mode (ops.invariance) in the torch parts the model computes
        itself: the edge LoRA deltas, and a mixture of experts' router LoRA and shared expert
        gate, a row at a time (ops.per_row)."""
        self.fixed_order = on
        for module in self.modules():
            if isinstance(module, MoeBlock):
                module.fixed_order = on

    def load_quantized_embedding(self, blocks) -> None:
        """The embedding as quantized blocks (ops.quant_dense.QuantBlocks, [vocab, hidden]):
        a tied head serves from them too; an untied model keeps them in embed_table."""
        if self.dims.tie_word_embeddings:
            self.lm_head.load_slice(None, "weight", blocks)
        else:
            d = self.dims
            table = Dense(d.hidden_size, (d.vocab_size,), False, self.lm_head.weight.dtype, "cpu")
            table.load_slice(None, "weight", blocks)
            self.embed_table = table

    @torch.no_grad()
    def finish_loading(self, dense: DenseChooser, fused, quant: QuantChooser | None = None) -> None:
        """Called once the checkpoint is in: tie the head, convert every weight for the backend
        dense(n, k, rows) picks for its [n, k] shape (a weight loaded as quantized blocks:
        quant(format)'s), set the fused element-wise layers. A tied head whose backend reads
        rows back (ops.dense.has_rows) is the embedding too: the embedding's own copy is
        dropped (vocab x hidden weights held once)."""
        if self.dims.tie_word_embeddings and not self.lm_head.quant_parts:
            self.lm_head.weight.copy_(self.embed_tokens.weight)
        self.fused = fused
        for module in self.modules():
            if isinstance(module, RMSNorm) and self.dims.norm_offset:
                module.weight.add_(1.0)  # Gemma: the checkpoint holds weight - 1
        for module in self.modules():
            if isinstance(module, Dense):
                blocks = module.quantized_weight()
                rows = self._dense_rows(module)
                if blocks is not None:
                    if quant is None:
                        raise ValueError(f"{blocks.name}: quantized, and no quantized backend")
                    backend = quant(blocks.format, blocks.n, blocks.k, rows)
                    module.prepare_quantized(blocks, backend)
                    continue
                module.prepare(dense(module.out_features, module.in_features, rows))
            elif isinstance(module, RMSNorm):
                module.fused = fused
        if self.embed_table is not None or (
            self.dims.tie_word_embeddings and has_rows(self.lm_head.backend)
        ):
            self.embed_from_head = self.embed_table is None
            self.embed_tokens.weight = nn.Parameter(
                self.embed_tokens.weight.new_empty(0, self.dims.hidden_size), requires_grad=False
            )
        _pin_submodules(self)

    def _dense_rows(self, module: Dense) -> tuple[int, ...]:
        """The row counts a Dense's backend is chosen for: a decode step's and a prefill
        chunk's, the LM head's sampled rows, none for an embedding table (rows() only)."""
        if module is self.embed_table:
            return ()
        return HEAD_ROWS if module is self.lm_head else PROJECTION_ROWS

    def float_dense_shapes(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(n, k, rows) of every Dense loaded in float (not as quantized blocks), before
        finish_loading: the shapes choose_dense will be asked for."""
        return [
            (m.out_features, m.in_features, self._dense_rows(m))
            for m in self.modules()
            if isinstance(m, Dense) and not m.quant_parts and m is not self.embed_table
        ]

    def weight_formats(self) -> str:
        """What the dense weights are served as, e.g. "bfloat16" or "Q4_1,Q8_0": the block
        formats of quantized ones (ops.quant_dense), the dtype of the others, sorted."""
        formats = set()
        for module in self.modules():
            if isinstance(module, Dense) and module.backend is not None:
                fmt = getattr(module.backend, "format", None)
                formats.add(fmt or str(module.weight.dtype).removeprefix("torch."))
        return ",".join(sorted(formats))

    @torch.inference_mode()
    def forward(
        self, batch: Batch, kv: torch.Tensor, backend: SgmvBackend | None = None
    ) -> torch.Tensor:
        """Run every row of the batch; returns logits float32 [B (+ P), vocab] of
        batch.sample_rows (then the prompt-scoring rows: batch.logit_rows when set)."""
        ids = batch.input_ids
        # [T, hidden], a fresh tensor updated in place below
        if self.embed_table is not None:
            residual = self.embed_table.rows(ids)
        else:
            residual = self.lm_head.rows(ids) if self.embed_from_head else self.embed_tokens(ids)
        if batch.lora is not None and batch.lora.embed:
            _add_embed_lora(residual, ids, batch.lora.embed, self.fixed_order)
        if self.dims.embed_scale != 1.0:  # Gemma: the scale in the serving dtype, as HF
            residual.mul_(torch.tensor(self.dims.embed_scale, dtype=residual.dtype))
        layers, fused = list(self.layers), self.fused
        normed = layers[0].input_layernorm(residual)
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        # forward() called directly here and in the layers: Module.__call__'s hook checks cost
        # ~2 us a call, ~6 calls a layer (no hooks are registered on these modules)
        for i, (layer, next_norm, rope) in enumerate(zip(layers, next_norms, self.layer_ropes)):
            normed = layer.forward(normed, residual, next_norm, batch, i, kv, rope, backend, fused)
        rows = batch.sample_rows if batch.logit_rows is None else batch.logit_rows
        x = normed[rows]
        logits = self.lm_head.dense(x).float()
        if batch.lora is not None and batch.lora.head:
            _add_head_lora(logits, x, rows, batch.lora.head, self.fixed_order)
        cap = self.dims.final_softcap
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits


def _pin_submodules(root: nn.Module) -> None:
    """Every submodule of root's tree also in its parent's instance __dict__, where attribute
    lookup finds it without Module.__getattr__ (~0.5 us a lookup; a decode step reads ~10
    submodules per layer). Module.__setattr__ drops the pin when a name is re-assigned a
    module, parameter or buffer; a child set to None or deleted later would keep a stale pin,
    which loading never does after finish_loading."""
    for module in root.modules():
        for name, child in module._modules.items():
            if child is not None:
                module.__dict__[name] = child


def _add_embed_lora(residual, ids, segments, fixed_order: bool = False) -> None:
    """PEFT's LoRA on an embedding, in place: rows [lo, hi) += A^T[ids] @ B^T (scaled B),
    computed in float32. Gemma's embedding scale, applied after, scales it as PEFT does."""
    for lo, hi, a_t, b_t in segments:
        delta = products(a_t[ids[lo:hi]].float(), [b_t.float()], fixed_order)  # [rows, hidden]
        residual[lo:hi] += delta.to(residual.dtype)


def _add_head_lora(logits, x, rows, segments, fixed_order: bool = False) -> None:
    """PEFT's LoRA on the LM head, in place on the float32 logits of `rows` (row indices into
    the step, x = their hidden states): each logit row whose step row lies in [lo, hi) gets
    (x @ A^T) @ B^T of that segment's adapter, before any final soft-capping."""
    for lo, hi, a_t, b_t in segments:
        picked = ((rows >= lo) & (rows < hi)).nonzero().squeeze(1)
        if picked.numel():
            mats = [a_t.float(), b_t.float()]
            logits[picked] += products(x[picked].float(), mats, fixed_order)
