"""Quantization on load (--quantization int8 | int4): the float weights of a checkpoint's
projections and LM head become ggml blocks (ops.quant_dense) before the model is prepared.

int8: every projection and the head in Q8_0 (blocks of 32 weights, an fp16 scale each).
int4: the projections in Q4_1 (blocks of 32 4-bit weights with an fp16 scale and min, what
the default GGUF file ships), the head in Q8_0 (as llama.cpp's converter keeps it). A tied head
is quantized from the embedding and then serves the embedding's rows too; an untied embedding
stays in the serving dtype (it is read a row per token, not multiplied). Weights already in
blocks (a GGUF file read natively) stay as they are. Quantizing uses the gguf package's
reference quantizers (round to nearest, as llama.cpp's quantize without an imatrix).
"""

from __future__ import annotations

import numpy as np
import torch

from punica_x.layers.linear import Dense, LoraLinear
from punica_x.models.moe import MoeBlock
from punica_x.ops.quant_dense import BLOCK, QuantBlocks

ON_LOAD = {"int8": ("Q8_0", "Q8_0"), "int4": ("Q4_1", "Q8_0")}  # (projections, head)


def quantize_blocks(name: str, weight: torch.Tensor, fmt: str) -> QuantBlocks:
    """An [n, k] float weight as `fmt` blocks; ValueError naming it when k is not a multiple
    of 32 or a value is not finite."""
    from gguf import GGMLQuantizationType, quants

    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{name}: cannot quantize {k} input features (not a multiple of {BLOCK})")
    values = weight.detach().to("cpu", torch.float32)
    if not torch.isfinite(values).all():
        raise ValueError(f"{name}: non-finite weights cannot be quantized")
    data = quants.quantize(np.ascontiguousarray(values.numpy()), GGMLQuantizationType[fmt])
    return QuantBlocks(name, fmt, torch.from_numpy(data.reshape(n, -1).copy()), k)


@torch.no_grad()
def quantize_on_load(model, mode: str) -> None:
    """Give every float projection, every expert of a mixture of experts (its shared expert
    too) and the head of `model` (models.llama.LlamaForCausalLM) blocks to serve from
    (Dense.quant_parts); finish_loading then prepares them. A router stays in the serving
    dtype, as llama.cpp keeps ffn_gate_inp: E x hidden values that pick the experts."""
    proj_fmt, head_fmt = ON_LOAD[mode]
    tied = model.dims.tie_word_embeddings
    experts = {id(m) for b in model.modules() if isinstance(b, MoeBlock) for m in b.experts()}
    for name, module in model.named_modules():
        if not isinstance(module, Dense) or module.quant_parts or module is model.embed_table:
            continue
        is_head = module is model.lm_head
        source = model.embed_tokens.weight if is_head and tied else module.weight
        projection = isinstance(module, LoraLinear) or id(module) in experts
        fmt = head_fmt if is_head else proj_fmt if projection else None
        if fmt is not None:
            module.quant_parts = {None: quantize_blocks(f"{name}.weight", source, fmt)}
