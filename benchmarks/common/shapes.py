"""Random-weight models of real models' shapes, for throughput figures of families other than
the default SmolLM2 (no model hub is reachable here; for speed only the shapes matter).

random_model("qwen2.5-0.5b") builds, once, a HF folder in the punica-x cache: transformers'
own config class with the real model's sizes, weights drawn by HF's initialiser and stored
in bfloat16, and SmolLM2's tokenizer files (its ids are a subset of the model's vocabulary;
ids past the tokenizer's decode to nothing, which the benchmarks do not read)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from punica_x.env import cache_dir
from punica_x.models.loader import resolve_model_dir

SHAPES = {
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
}


def random_model(shape: str) -> Path:
    """The folder of a random-weight model of `shape` (a key of SHAPES), built on first use."""
    import transformers

    config_cls, model_cls, fields = SHAPES[shape]
    target = cache_dir("models") / f"random-{shape}"
    if (target / "config.json").exists():
        return target
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**fields)
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(None))
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_path(name: str | None) -> str | None:
    """--model: None (the default SmolLM2), a SHAPES key (its random model) or a path."""
    return str(random_model(name)) if name in SHAPES else name
