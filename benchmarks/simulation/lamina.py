"""Lamina's decode cost model (model-attention disaggregation, arXiv 2405.01814, issue 49):
a roofline of one decode step of B requests (a token each, `context_len` tokens of KV each)
on GPUs at bw_eff of their bandwidth and flops_eff of their compute:

- model part M (projections, MLP, LM head): max(2 matmul_params B flops, one read of the
  weights) over its TP group of g GPUs; for g > 1 two ring all-reduces a layer of
  B hidden 2 bytes (2 (g - 1) / g of them over NVLink), allreduce_latency_s each;
- attention A: max(the batch's KV bytes, its flops) over the GPUs holding the KV;
- Lamina's exchange X: q, k, v out and the attention output back, qkvo 2 bytes a token a
  layer over the narrower side's NICs at net_eff; L = layers 2 net_latency_s (a round trip
  a layer); step_overhead_s once a step (scheduling, sampling, launch gaps).

Batch: homogeneous (vLLM-like) (g memory mem_fraction - weights) // (KV of a request);
Lamina a memory mem_fraction // (KV of a request) on its a attention GPUs, the m model GPUs
holding the weights only; both capped at max_batch. tokens/s = B / step, where homogeneous
step = M(B) + A(B) + overhead, and Lamina with n concurrent batches of b = B / n (rotational
staggered pipelining, sec. 4.3):
    step(n) = max(n M(b), n A(b), n X(b), M(b) + A(b) + X(b) + L) + overhead
n M(b): one model replica (TP over the m; n - 1 = 1 replica at n = 2, as in the paper's
runs) runs every batch's slices in turn; n A(b): the attention GPUs serve every batch; the
last term, one batch's own chain. The paper sizes the attention GPUs so t_a = t_m / (n - 1);
here the price fixes their count and the max names the side that binds. n = 1 is unpipelined,
M(B) + A(B) + X(B) + L + overhead; pipelined is the best over n = 1..max_batches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """An accelerator: memory_gb (1e9 bytes), bandwidth_gbs (HBM, GB/s), tflops (dense
    bf16), price_per_hour (US$ a GPU), net_gbs (its NIC), nvlink_gbs (one way)."""

    name: str
    memory_gb: float
    bandwidth_gbs: float
    tflops: float
    price_per_hour: float
    net_gbs: float = 50.0  # 400 Gbps a GPU (the paper's testbed: one ConnectX-7 each)
    nvlink_gbs: float = 450.0


# $/h: H100, H20 from Lamina's Table 1 (Google Cloud a GPU; H20 "estimated using the relative
# complete system cost against H100"); A100 80GB: our guess (~GCP a2-ultragpu), not the paper's
DEVICES = {
    "a100": Device("A100", 80, 2039, 312, 5.07, net_gbs=25.0, nvlink_gbs=300.0),
    "h100": Device("H100", 80, 3350, 989, 11.06),
    "h20": Device("H20", 96, 4000, 148, 4.63),
}


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder (GQA; a layer: q, k, v, o and 3 SwiGLU MLP matrices; untied
    embedding and LM head). exchange_bytes_per_token: Lamina's q, k, v out and output back."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2

    kv_width = property(lambda s: 2 * s.kv_heads * s.head_dim)  # k and v side by side
    # q, k, v, o side by side: a layer's attention matrices' width; Lamina's exchange, a token
    qkvo = property(lambda s: 2 * s.heads * s.head_dim + s.kv_width)
    params = property(lambda s: s.hidden * (2 * s.vocab + s.layers * (s.qkvo + 3 * s.intermediate)))
    matmul_params = property(lambda s: s.params - s.vocab * s.hidden)  # embedding: looked up
    weight_bytes = property(lambda s: s.params * s.bytes_per_param)
    kv_bytes_per_token = property(lambda s: s.layers * s.kv_width * s.bytes_per_param)
    exchange_bytes_per_token = property(lambda s: s.qkvo * s.bytes_per_param)


MODELS = {
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama-65b": ModelShape("llama-65b", 80, 8192, 64, 64, 128, 22016, 32000),
    "llama-33b": ModelShape("llama-33b", 60, 6656, 52, 52, 128, 17920, 32000),
}


@dataclass(frozen=True)
class Knobs:
    """Assumptions for both designs (documented, not fitted to the paper); GPUs compared."""

    mem_fraction: float = 0.9  # usable HBM (vLLM's gpu_memory_utilization default)
    bw_eff: float = 0.8  # achievable HBM bandwidth (paper fig. 3: attention MBU > 70%)
    flops_eff: float = 0.7  # achievable dense GEMM throughput at large batch
    net_eff: float = 0.9  # FHBN reached 45.7 GB/s, 91.4% of 400 Gbps (sec. 6.3)
    net_latency_s: float = 16.5e-6  # one way: half of FHBN's 33 us ping-pong
    allreduce_latency_s: float = 10e-6
    step_overhead_s: float = 2e-3
    max_batch: int = 1024
    max_batches: int = 2  # Lamina's concurrent batches tried (2: one model replica)
    price_margin: float = 0.05  # Lamina may cost up to this much more than homogeneous
    compute: str = "h100"  # the homogeneous GPUs and Lamina's model workers
    memory: str = "h20"  # Lamina's attention workers


@dataclass(frozen=True)
class Case:
    """What is decoded: a model, the mean context length of its requests, the knobs."""

    shape: ModelShape
    context_len: int
    knobs: Knobs = Knobs()

    def __post_init__(self) -> None:
        if self.context_len <= 0:
            raise ValueError(f"context length must be positive, got {self.context_len}")

    def requests_in(self, room: float, where: str) -> int:
        """Requests whose KV fits in `room` bytes (capped); ValueError if room < 0."""
        if room < 0:
            gb = f"{self.shape.weight_bytes / 1e9:.1f} GB of weights"
            raise ValueError(f"{self.shape.name} ({gb}) does not fit on {where}")
        kv = self.shape.kv_bytes_per_token * self.context_len
        return min(self.knobs.max_batch, int(room // kv))


@dataclass(frozen=True)
class Pool:
    """`gpus` GPUs of one kind; alone, the homogeneous (vLLM-like, tensor parallel) config."""

    device: Device
    gpus: int

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"a pool of {self.device.name} needs at least 1 GPU, got {self.gpus}")

    price = property(lambda self: self.gpus * self.device.price_per_hour)
    label = property(lambda self: f"{self.gpus}x{self.device.name}")

    def usable(self, k: Knobs) -> float:
        return self.gpus * self.device.memory_gb * 1e9 * k.mem_fraction


@dataclass(frozen=True)
class Lamina:
    """Model workers (weights only, TP) and attention workers (KV only): DOP (m, a)."""

    model: Pool
    attention: Pool

    price = property(lambda self: self.model.price + self.attention.price)
    label = property(lambda s: f"Lamina {s.model.label}+{s.attention.label}")


@dataclass(frozen=True)
class Step:
    """One decode step of `batch` requests: one batch's parts (ms of M, A, X + L) and total."""

    batch: int
    model_s: float
    attention_s: float
    network_s: float
    step_s: float
    concurrent_batches: int = 1

    tokens_per_s = property(lambda self: self.batch / self.step_s if self.batch else 0.0)


def roofline(flops: float, nbytes: float, pool: Pool, k: Knobs) -> float:
    compute = flops / (pool.gpus * pool.device.tflops * 1e12 * k.flops_eff)
    return max(compute, nbytes / (pool.gpus * pool.device.bandwidth_gbs * 1e9 * k.bw_eff))


def model_time(case: Case, pool: Pool, batch: float) -> float:
    """Seconds of the non-attention part on `pool` (TP), its all-reduces included."""
    s, k, g = case.shape, case.knobs, pool.gpus
    io = s.matmul_params * s.bytes_per_param + 2 * batch * s.hidden * s.layers * 2
    t = roofline(2 * s.matmul_params * batch, io, pool, k)
    ring = 2 * (g - 1) / g * batch * s.hidden * s.bytes_per_param
    allreduce = 2 * s.layers * (k.allreduce_latency_s + ring / (pool.device.nvlink_gbs * 1e9))
    return t + (allreduce if g > 1 else 0.0)


def attention_time(case: Case, pool: Pool, batch: float) -> float:
    """Seconds of decode attention on `pool`, which holds the batch's KV."""
    s, ctx = case.shape, case.context_len
    flops = 4 * batch * ctx * s.heads * s.head_dim * s.layers
    return roofline(flops, batch * ctx * s.kv_bytes_per_token, pool, case.knobs)


def homogeneous_step(case: Case, pool: Pool, batch: int | None = None) -> Step:
    """The vLLM-like step at `batch` (default: the most requests whose KV fits beside the
    weights; 0 if not one does; ValueError if the weights do not fit)."""
    room = pool.usable(case.knobs) - case.shape.weight_bytes
    b = case.requests_in(room, pool.label) if batch is None else batch
    m, a = model_time(case, pool, b), attention_time(case, pool, b)
    return Step(b, m, a, 0.0, m + a + case.knobs.step_overhead_s)


def lamina_step(case: Case, cfg: Lamina, batch: int | None = None, batches: int = 0) -> Step:
    """Lamina's step, `batch` requests (default: the most whose KV fits on the attention
    GPUs) in `batches` concurrent batches (0: the best of 1..max_batches), as in the module
    doc; ValueError if the model GPUs cannot hold the weights."""
    if batches < 1:
        tries = [lamina_step(case, cfg, batch, n) for n in range(1, case.knobs.max_batches + 1)]
        return max(tries, key=lambda s: (s.tokens_per_s, -s.concurrent_batches))
    s, k = case.shape, case.knobs
    case.requests_in(cfg.model.usable(k) - s.weight_bytes, cfg.model.label)
    total = case.requests_in(cfg.attention.usable(k), cfg.label) if batch is None else batch
    b = total / batches
    m, a = model_time(case, cfg.model, b), attention_time(case, cfg.attention, b)
    nics = min(p.gpus * p.device.net_gbs for p in (cfg.model, cfg.attention))
    x = b * s.layers * s.exchange_bytes_per_token / (nics * 1e9 * k.net_eff)
    lat = s.layers * 2 * k.net_latency_s
    step = max(batches * m, batches * a, batches * x, m + a + x + lat) + k.step_overhead_s
    return Step(total, m, a, x + lat, step, batches)


def equal_cost_rows(shape: ModelShape, contexts: list[int], gpus: list[int], k: Knobs = Knobs()):
    """Per homogeneous size g and context, a row for g x k.compute (TP) then one for Lamina
    (pipelined): g // 2 of them + the most k.memory GPUs that cost at most price_margin more
    and split the KV heads evenly (Lamina partitions attention by head). Sizes where g // 2
    GPUs cannot hold the weights are left out."""
    cases, rows, mem = [Case(shape, ctx, k) for ctx in contexts], [], DEVICES[k.memory]
    for g in gpus:
        homog, model = Pool(DEVICES[k.compute], g), Pool(DEVICES[k.compute], max(1, g // 2))
        if g < 2 or model.usable(k) < shape.weight_bytes:
            continue
        budget = homog.price * (1 + k.price_margin) - model.price
        fit = range(int(budget // mem.price_per_hour), 0, -1)
        n = next((n for n in fit if shape.kv_heads % n == 0 or n % shape.kv_heads == 0), 0)
        lam = Lamina(model, Pool(mem, n))  # n = 0: ValueError, no memory GPU fits the budget
        for case in cases:
            h, plain = homogeneous_step(case, homog), lamina_step(case, lam, batches=1)
            rows += [_row(case, homog, h, h, h), _row(case, lam, lamina_step(case, lam), h, plain)]
    return rows


def _row(case: Case, cfg: Pool | Lamina, s: Step, base: Step, plain: Step) -> dict:
    vs, lamina = isinstance(cfg, Lamina) and base.batch > 0, isinstance(cfg, Lamina)
    return {
        "model": case.shape.name, "context": case.context_len, "config": cfg.label,
        "price_per_h": round(cfg.price, 2), "batch": s.batch, "batches": s.concurrent_batches,
        "step_ms": s.step_s * 1e3, "model_ms": s.model_s * 1e3,
        "attention_ms": s.attention_s * 1e3, "network_ms": s.network_s * 1e3,
        "tokens_per_s": s.tokens_per_s, "tokens_per_s_per_dollar_h": s.tokens_per_s / cfg.price,
        "unpipelined_tokens_per_s": plain.tokens_per_s if lamina else None,
        "gain": s.tokens_per_s / base.tokens_per_s - 1 if vs else None,
        "batch_ratio": s.batch / base.batch if vs else None,
    }  # fmt: skip
