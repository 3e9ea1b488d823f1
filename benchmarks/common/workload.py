"""The multi-LoRA workload the engine benchmarks share: chat prompts on a few topics, rank-r
adapters on all 7 projections of the default model, and the adapter popularity workloads
(Distinct / Uniform / Skewed (Zipf 1.5) / Identical) as per-request adapter names a0, a1, ..."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from punica_x.workloads import assign_adapters

WORKLOADS = {
    "distinct": "distinct",
    "uniform": "uniform",
    "skewed": "zipf-1.5",
    "identical": "identical",
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
TOPICS = [
    "the ocean",
    "volcanoes",
    "honey bees",
    "the moon",
    "jazz",
    "chess",
    "bread",
    "rivers",
    "glaciers",
    "owls",
    "trains",
    "tea",
    "deserts",
    "comets",
    "coral reefs",
    "maple trees",
]


def make_prompts(tokenizer, n: int, warm_up: bool = False) -> list[str]:
    """n chat prompts; warm_up: other questions in the same template, for warming an engine
    up without caching the measured prompts (vLLM's prefix cache keeps every full KV block of
    a prompt it has seen: warmed up on the measured prompts, it would skip their prefill)."""
    ask = "Name three things about {}." if warm_up else "Tell me {} about {}."
    qs = [
        ask.format(TOPICS[(i + 5) % len(TOPICS)])
        if warm_up
        else ask.format("one fact" if i % 2 else "a short story", TOPICS[i % len(TOPICS)])
        for i in range(n)
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in qs
    ]


def make_adapters(model_dir: Path, n: int, rank: int, root: Path) -> list[Path]:
    """n PEFT adapters of `rank` on all 7 projections (random, seeds 1000..; a mixture of
    experts: on its attention, its experts and its router, EXPERT_PARAMETERS), saved to
    root/a0, root/a1, ... The adapters do not depend on the base's weights: a directory
    without them (a GGUF file's metadata directory, read natively) gives the same ones."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if any(Path(model_dir).glob("*.safetensors")):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    targets, params = TARGETS, None
    if getattr(base.config, "num_experts", None) or getattr(base.config, "num_local_experts", 0):
        targets, params = TARGETS[:4], EXPERT_PARAMETERS  # the MLP is experts: attention + them
    paths = []
    for i in range(n):
        torch.manual_seed(1000 + i)
        config = LoraConfig(
            r=rank,
            lora_alpha=rank,
            target_modules=targets,
            target_parameters=params,
            init_lora_weights=False,
        )
        model = get_peft_model(base, config)
        model.save_pretrained(root / f"a{i}")
        base = model.unload()
        paths.append(root / f"a{i}")
    return paths


def random_adapters(model_dir: Path, n: int, rank: int, root: Path) -> list[Path]:
    """n PEFT adapters of `rank` on all 7 projections in bfloat16, written straight from the
    config's shapes (no base model loaded: an 8B one in float32 would not fit beside the
    servers): A ~ N(0, 1 / in), B ~ N(0, 1e-4), seeds 1000.., saved to root/a0, ..."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from punica_x.models.llama import LlamaDims

    cfg = AutoConfig.from_pretrained(model_dir)
    shapes = {  # module: (in, out)
        ("self_attn." if p[0] in "qkvo" else "mlp.") + p: io
        for p, io in LlamaDims.from_hf_config(cfg).lora_shapes().items()
    }
    paths = []
    for a in range(n):
        gen = torch.Generator().manual_seed(1000 + a)
        state = {}
        for layer in range(cfg.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{module}"
                state[f"{key}.lora_A.weight"] = (
                    torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                )
                state[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 1e-2
        path = root / f"a{a}"
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.to(torch.bfloat16) for k, v in state.items()}
        save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS).save_pretrained(path)
        paths.append(path)
    return paths


def weights_dir(llm, model: str | None = None) -> Path:
    """A HF directory holding the weights of llm's model, for peft to build adapters on: its
    own, or for a GGUF file read natively (whose directory holds none) the file dequantized
    (models.loader.convert_gguf, cached)."""
    own = llm.engine.loaded.model_dir
    if any(own.glob("*.safetensors")):
        return own
    from punica_x.models.loader import convert_gguf, gguf_file

    return convert_gguf(gguf_file(model))


def load_adapters(llm, paths: list[Path]) -> list:
    """Load the adapters into an LLM as a0, a1, ...; returns what each load_adapter returned."""
    return [llm.load_adapter(f"a{i}", str(p)) for i, p in enumerate(paths)]


def workload_names(n: int, workloads=tuple(WORKLOADS)) -> dict[str, list[str]]:
    """Per workload, the adapter name of each of n requests (the same draw, seed 7, every
    time)."""
    return {
        w: [f"a{i}" for i in assign_adapters(WORKLOADS[w], n, random.Random(7))] for w in workloads
    }


def with_base_model(picks: list[int], adapters: int) -> list[str | None]:
    """Adapter picks folded onto `adapters` slots, the last slot the base model (None):
    a0 .. a{adapters-2} and the base."""
    return [None if i % adapters == adapters - 1 else f"a{i % adapters}" for i in picks]
