"""Frozen, validated configuration of one runner (model, KV cache, LoRA pool, batching)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from punica_x.dtypes import DTYPES, dtype_name  # noqa: F401  (dtype_name: re-exported)
from punica_x.ops.invariance import check_mode

GiB = 1 << 30


def _positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """model: a HF directory (config.json + *.safetensors), a .gguf file, or None for the
    default SmolLM2-135M-Instruct. dtype "auto": bfloat16 on CPUs that compute in it natively
    (AVX512-BF16 or AMX-BF16 in the CPU flags), float32 on other CPUs (bf16 works there too,
    with float32 arithmetic, but is asked for explicitly), bfloat16 (or float16 where bf16 is
    unsupported) on CUDA. max_model_len: None takes the model's own limit.
    dense_backend / fused_backend: None chooses by device (punica_x.ops.dense, .fused).
    quantization: "auto" (the default) serves a GGUF file's quantized tensors in their own
    blocks where the CPU kernels take them (Q4_0, Q4_1, Q8_0 of a llama-architecture file:
    punica_x.models.gguf_native; GPTQ / AWQ projections as blocks too), so the default model
    runs in its own Q4_1; off the CPU (no kernels for blocks there yet) auto dequantizes them
    to the serving dtype, says so in the log and reports the dtype as the weight format.
    "none" dequantizes the whole file to the serving dtype (the exact reference); other
    checkpoints load as they are with either. "int8" / "int4" read a GGUF file as auto does
    and quantize the float weights of any checkpoint on load (punica_x.models.quantize: Q8_0 /
    Q4_1 projections, a Q8_0 head); CPU only, refused at start on other devices.
    quant_activations: how x meets weights served in blocks. "int16" (default) and "int8"
    round each block of 32 values of x to integers with its own scale and multiply in integer
    dot products: int16 (steps of 1/16256 of a block's largest value) within a few times
    float32 summation noise of "float"; int8 is llama.cpp's
    arithmetic, the fastest (steps of 1/127 of a block's largest value: a model with outlier
    activations, as SmolLM2, moves its logprobs by up to ~1 nat); "float": x stays in the
    serving dtype, the exact reference of the blocks' values. Float weights are not affected."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    dense_backend: str | None = None
    fused_backend: str | None = None
    quantization: str = "auto"
    quant_activations: str = "int16"
    # the same request gives the same bits whatever else runs (punica_x/ops/invariance.py):
    # "auto" (on where its measured cost is at most 5%), "on" or "off"
    batch_invariant: str = "auto"
    # benchmarks only: the forward replaced by a simulated device that holds this many ms of
    # wall time a step without the interpreter lock (punica_x/models/simulated.py); None: off
    simulated_step_ms: float | None = None

    QUANTIZATION = ("auto", "none", "int8", "int4")
    QUANT_ACTIVATIONS = ("int16", "int8", "float")

    def __post_init__(self) -> None:
        if self.quantization not in self.QUANTIZATION:
            raise ValueError(
                f"quantization must be one of {self.QUANTIZATION}, got {self.quantization!r}"
            )
        if self.quant_activations not in self.QUANT_ACTIVATIONS:
            raise ValueError(
                f"quant_activations must be one of {self.QUANT_ACTIVATIONS}, "
                f"got {self.quant_activations!r}"
            )
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        _positive("max_model_len", self.max_model_len)
        check_mode(self.batch_invariant)
        ms = self.simulated_step_ms
        if ms is not None and (
            isinstance(ms, bool) or not isinstance(ms, int | float) or not 0 < ms <= 60_000
        ):
            raise ValueError(f"simulated_step_ms must be a number in (0, 60000], got {ms!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def served_quantization(self) -> str:
        """What the loader does with quantized weights on this config's device: the asked
        quantization on the CPU; off it, "auto" is "none" (blocks have CPU kernels only) and
        "int8" / "int4" are refused (ValueError)."""
        if self.quantization == "none" or self.torch_device().type == "cpu":
            return self.quantization
        if self.quantization == "auto":
            return "none"
        raise ValueError(
            f"quantization {self.quantization!r} runs on the CPU only for now (no kernels for "
            f"quantized blocks on {self.torch_device().type}); use auto or none there"
        )

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device().type == "cpu":
            from punica_x.ops import isa

            return torch.bfloat16 if isa.native_bf16() else torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: blocks (rBlocks) of `block_size` tokens. The pool holds `num_blocks`
    blocks, or as many as fit in `kv_cache_bytes` (None: 2 GiB, or the memory plan's size
    where memory is planned: a size given here turns the default planning on CUDA off)."""

    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_blocks: int | None = None
    # host-memory pool the MLFQ policy swaps preempted requests' KV into (0: none, they
    # recompute); pinned on a GPU; swap_blocks counts blocks instead of bytes
    swap_bytes: int = 1 * GiB
    swap_blocks: int | None = None
    # automatic prefix caching (punica_x/kv/prefix.py): a request reuses the cached KV of
    # the longest prefix of its tokens computed by the same model or adapter version (and
    # salt); full blocks stay cached after their request ends, evicted LRU when needed
    prefix_caching: bool = True

    DEFAULT_KV_CACHE_BYTES = 2 * GiB

    @property
    def sized(self) -> bool:
        """Whether the cache's size is given (not the default)."""
        return self.num_blocks is not None or self.kv_cache_bytes is not None

    def __post_init__(self) -> None:
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be a bool, got {self.prefix_caching!r}")
        _positive("block_size", self.block_size)
        if self.swap_bytes < 0 or (self.swap_blocks is not None and self.swap_blocks < 0):
            raise ValueError("swap_bytes and swap_blocks must be >= 0")
        _positive("kv_cache_bytes", self.kv_cache_bytes)
        _positive("num_blocks", self.num_blocks)


@dataclass(frozen=True)
class LoraConfig:
    """Adapter pool. Device slots are budgeted in bytes (an adapter costs what its ranks and
    target modules cost); behind them an LRU host cache of validated adapters.

    lora_dtype: what the adapters' weights are stored and read in (vLLM's --lora-dtype). "auto":
    the serving dtype. "bfloat16" under a float32 model on the CPU: half the bytes per
    adapter, in the pools and in every LoRA launch (a step of distinct adapters is bound by
    reading them), each weight rounded to bfloat16 once at load and widened exactly as the
    kernels load it; activations and sums stay float32. Any other pair than the serving dtype
    itself or that one is refused (torch_dtype)."""

    LORA_DTYPES = ("auto", *DTYPES)

    max_lora_rank: int = 64
    device_bytes: int = 1 * GiB
    host_bytes: int = 4 * GiB
    lora_dtype: str = "auto"
    # vLLM's --max-loras / --max-cpu-loras: the device pool / host cache sized to hold this
    # many adapters of max_lora_rank on every projection (lora/slots.py), in place of
    # device_bytes / host_bytes; None: the byte budgets as given (or as memory planning sets)
    max_loras: int | None = None
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _positive("max_lora_rank", self.max_lora_rank)
        _positive("device_bytes", self.device_bytes)
        _positive("host_bytes", self.host_bytes)
        for name in ("max_loras", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 100_000
            ):
                raise ValueError(f"{name} must be an integer in 1..100000, got {value!r}")
        if not isinstance(self.lora_dtype, str) or self.lora_dtype not in self.LORA_DTYPES:
            raise ValueError(
                f"lora_dtype must be one of {self.LORA_DTYPES}, got {self.lora_dtype!r}"
            )

    def torch_dtype(self, serving: torch.dtype, device: torch.device) -> torch.dtype:
        """The adapters' dtype for a model served in `serving` on `device`; ValueError for a
        pair no kernel takes (the weights in the serving dtype, or bfloat16 under float32 on
        the CPU)."""
        if self.lora_dtype == "auto" or DTYPES[self.lora_dtype] == serving:
            return serving
        wanted = DTYPES[self.lora_dtype]
        if wanted == torch.bfloat16 and serving == torch.float32 and device.type == "cpu":
            return wanted
        raise ValueError(
            f"lora_dtype {self.lora_dtype} with a {dtype_name(serving)} model on "
            f"{device.type} is not served: adapters are stored in the model's dtype (lora_dtype "
            f"auto), or in bfloat16 under a float32 model on the CPU"
        )


def _share(name: str, value, low_open: bool, high: float, high_open: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (value > 0 if low_open else value >= 0)
    ok = ok and (value < high if high_open else value <= high)
    if not ok:
        bound = f"0 < {name} {'<' if high_open else '<='} {high:g}"
        raise ValueError(f"{name} must be a number with {bound}, got {value!r}")


@dataclass(frozen=True)
class MemoryConfig:
    """Memory planning (punica_x/engine/memory.py). utilization: this engine's share of the
    device's memory, from which the KV cache and the adapter pool are sized after a
    profiling step (vLLM's gpu_memory_utilization); None: 0.9 on CUDA, and on CPU the fixed
    sizes cache.kv_cache_bytes / num_blocks and lora.device_bytes (and on CUDA too when the
    cache's size is given). kv_fraction: the share of
    what the weights and one step leave that goes to the KV cache; the rest is the adapter
    pool's device budget."""

    utilization: float | None = None
    kv_fraction: float = 0.8

    def __post_init__(self) -> None:
        if self.utilization is not None:
            _share("utilization", self.utilization, True, 1.0, False)
        _share("kv_fraction", self.kv_fraction, True, 1.0, True)

    def effective_utilization(self, device: torch.device, sized: bool = False) -> float | None:
        """The share to plan with on `device`, or None: fixed sizes. sized: the cache's size
        is given (num_blocks or kv_cache_bytes), which the default planning leaves alone."""
        if self.utilization is not None:
            return self.utilization
        return 0.9 if device.type == "cuda" and not sized else None


POLICIES = ("fcfs", "mlfq")


@dataclass(frozen=True)
class BatchConfig:
    """Continuous batching: at most `max_batch_size` running requests and
    `max_batched_tokens` tokens (prefill chunks + one per decode) in one model invocation."""

    max_batch_size: int = 32
    max_batched_tokens: int = 2048
    # fcfs: arrival order (Punica); mlfq: skip-join MLFQ with KV swapping (FastServe), see
    # punica_x/batching/mlfq.py. mlfq_quantum_s / mlfq_levels override the measured q_1 /
    # level count
    policy: str = "fcfs"
    mlfq_quantum_s: float | None = None
    mlfq_levels: int | None = None
    mlfq_starve_s: float = 10.0
    # the longest generation the levels tell apart; longer ones share the last level in
    # arrival order (see punica_x/batching/batcher_mlfq.py for why 64 and not the longest)
    mlfq_job_tokens: int = 64
    # requests a runner holds (running + waiting in its batcher) before more wait at the
    # scheduler: the batch under FCFS; under MLFQ a pool to choose the batch from (4x batch)
    mlfq_working_set: int | None = None
    # DistKV (punica_x/kv/borrowing.py): the fraction of the local KV cache a request that
    # borrows on peers leaves free for the requests beside it while its peers lend
    borrow_headroom: float = 0.25
    # a prefill chunk longer than this takes only this many tokens a step while other
    # requests share the runner, so they join and decode beside a long prompt (vLLM's
    # long_prefill_token_threshold); 0: a chunk takes what the token budget leaves
    long_prefill_tokens: int = 512

    def __post_init__(self) -> None:
        _positive("max_batch_size", self.max_batch_size)
        _positive("max_batched_tokens", self.max_batched_tokens)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _positive("mlfq_starve_s", self.mlfq_starve_s)
        if self.mlfq_quantum_s is not None:
            _positive("mlfq_quantum_s", self.mlfq_quantum_s)
        if self.mlfq_levels is not None:
            _positive("mlfq_levels", self.mlfq_levels)
        _positive("mlfq_working_set", self.mlfq_working_set)
        _positive("mlfq_job_tokens", self.mlfq_job_tokens)
        cap = self.long_prefill_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(f"long_prefill_tokens must be an int >= 0, got {cap!r}")
        h = self.borrow_headroom
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise ValueError(f"borrow_headroom must be a number in [0, 1), got {h!r}")

    @property
    def max_working_set(self) -> int:
        """Requests a runner takes at once: the batch under FCFS (more wait at the
        scheduler, where another runner may take them); under MLFQ the pool its batches
        are chosen from, so a short request can overtake."""
        if self.policy == "fcfs":
            return self.max_batch_size
        return self.mlfq_working_set or 4 * self.max_batch_size


MAX_ATTENTION_WORKERS = 64
MAX_STREAM_INTERVAL = 4096


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    sgmv_backend: str | None = None
    attention_backend: str | None = None
    seed: int = 0
    # decode steps replayed from CUDA graphs (on CUDA, with the torch attention backend;
    # punica_x/engine/cuda_graphs.py); False: every step eager
    cuda_graphs: bool = True
    # Lamina (punica_x/attention/lamina.py): attention and the KV on this many attention
    # workers, each holding a slice of the KV heads (must divide the model's); 0: none
    attention_workers: int = 0
    # overlapped scheduling (punica_x/engine/overlap.py): the host plans step N+1 while the
    # device runs step N. "auto": on with the simulated device (or as PUNICA_X_OVERLAP says),
    # off on real devices until measured there; "on" / "off"
    overlap: str = "auto"
    # outputs go to the caller every this many tokens, the first and the last at once (vLLM's
    # --stream-interval): 1 streams each token; more cost the layers above less per token
    stream_interval: int = 1

    OVERLAP = ("auto", "on", "off")

    def __post_init__(self) -> None:
        if self.overlap not in self.OVERLAP:
            raise ValueError(f"overlap must be one of {self.OVERLAP}, got {self.overlap!r}")
        k = self.stream_interval
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_STREAM_INTERVAL:
            raise ValueError(
                f"stream_interval must be an integer in 1..{MAX_STREAM_INTERVAL}, got {k!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        n = self.attention_workers
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_ATTENTION_WORKERS:
            raise ValueError(
                f"attention_workers must be an integer in 0..{MAX_ATTENTION_WORKERS}, got {n!r}"
            )
