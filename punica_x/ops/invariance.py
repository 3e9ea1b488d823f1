"""Batch invariance (ModelConfig.batch_invariant): the same request gives the same bits,
whatever else is running.

A row's result must not depend on what else shares its kernel calls: how many rows a GEMM
has, where the row sits in the batch, how many rows share its adapter's SGMV segment, whether
its prompt came as one chunk, several, after a cached prefix or as a decode row. In bf16 a
last-bit difference flips a near-tie of greedy decoding within a few dozen tokens, so without
this a prefix-cache hit, a neighbour's traffic, chunked prefill, preemption or migration can
change a completion.

The mode holds every kernel a token passes through to one reduction order per row:
* dense projections and the LM head: the compiled ``cpu`` GEMM (csrc/dense), whose per-row
  sums run over K in one order whatever the row count (oneDNN and torch pick blockings by
  it), and quantized blocks without the dequantize-and-matmul path for large chunks;
* SGMV: the ``cpu`` kernels with ``fixed_order`` (sgmv.h: every segment takes the arithmetic
  of a segment of any size);
* attention: the paged kernel for every chunk, no flash attention (attention/cpu.py); a
  request whose KV lies on peers (DistKV) runs its parts in key order, each going on from
  the kernel's state the part before left, not merged (attention/dist.py);
* fused RMSNorm, RoPE and activations: the ``cpu`` kernels (one row at a time);
* LoRA on the embedding and the LM head, a mixture of experts' router LoRA and shared
  expert gate: their torch products and sigmoid a row at a time (ops.per_row,
  LlamaForCausalLM.hold_fixed_order);
sampling and logprobs are per row already.

``on``: these kernels (ValueError where they cannot run: a device other than a CPU or CUDA,
an untuned CPU, float16 on a CPU, CUDA without Triton, or a backend named that is not one of
them). ``off``: the fastest per shape (autotune).
``auto`` (the default): on where it costs at most MAX_COST on this CPU's kernels, measured at
first load, part by part (relative_cost of each), the largest part counting (a step's cost is
a weighted mean of its parts', so at most the largest):
* dense projections: the dense backends' timings on the model's own shapes (what autotune
  times anyway: rows 8, 32 and 256 per projection, 8 and 32 for the LM head), the time of the
  ``cpu`` GEMM over that of each shape's fastest backend, summed over the projections;
* LoRA: the SGMV cpu kernels in fixed order over their own (32 rows of 32 adapters and of
  one, per LoRA shape), on the builds where the two differ (ops.sgmv.ORDER_DIFFERS; elsewhere
  the orders are the same instructions, 0).
The other kernels of the mode are the ones a decode step runs anyway (the paged attention
takes decode rows with or without it; flash attention is for prompt chunks only).

On CUDA the mode is opt-in (``on``; ``auto`` is off there until its cost is measured on a
GPU): the dense projections and the LM head through a Triton GEMM whose tiles are fixed per
weight, never chosen by the row count (ops.triton_gemm; cuBLAS picks kernel and split-K by
M); RMSNorm one row per program (ops.triton_norm); a Triton paged attention with one program
per row and KV head, walking the keys block by block from the first (attention.triton_paged);
SGMV with its split of K fixed by the weight's width alone (csrc/sgmv/sgmv_cuda.cu); decode
graphs replay the Triton plan (engine/graph_attention.py). RoPE, the activations, sampling and
the logprobs stay torch's: element-wise, or softmax kernels sized by the vocabulary alone, a
row per block (the GPU-marked tests compare the logprobs' bits alone and in a batch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

MODES = ("auto", "on", "off")
MAX_COST = 0.05  # auto: the largest measured cost fraction of a part (relative_cost)
# the backend that computes batch-invariantly, by (device, kind); kind None: every other
# kind (on CUDA the SGMV kernels take the fixed order themselves)
INVARIANT_BACKENDS = {("cpu", None): "cpu", ("cuda", None): "triton", ("cuda", "SGMV"): "cuda"}
CUDA_AUTO = "auto: off on cuda, where the mode is opt-in (on) until its cost is measured there"


@dataclass(frozen=True)
class Invariance:
    """on: whether the kernels run in batch-invariant order; reason: why, for the start-up
    log and the engine's description; cost: the measured cost fraction (None: not measured)."""

    on: bool
    reason: str
    cost: float | None = None


def check_mode(mode: object) -> None:
    """ValueError unless `mode` is one of MODES."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"batch_invariant must be one of {', '.join(MODES)}, got {mode!r}")


def decide(
    mode: str,
    device_type: str,
    kernels: bool,
    named: Mapping[str, str | None],
    cost: Callable[[], Mapping[str, float]],
) -> Invariance:
    """The mode's decision. kernels: whether the batch-invariant kernels run this model here
    (CPU: a tuned x86 level, float32 or bfloat16; CUDA: Triton importable, a float dtype);
    named: {kind: backend a user named} (None or "" for none); cost(): the measured cost
    fraction of each part ({"dense projections": 0.01, "LoRA": 0.0}), called only for auto
    on a CPU; the largest decides. ValueError for `on` where the mode cannot hold."""
    check_mode(mode)
    if mode == "off":
        return Invariance(False, "batch_invariant=off")
    blocker = _blocker(device_type, kernels, named)
    if blocker:
        if mode == "on":
            raise ValueError(f"batch_invariant=on cannot hold: {blocker}; use off or auto")
        return Invariance(False, f"auto: off, {blocker}")
    if mode == "on":
        return Invariance(True, "batch_invariant=on")
    if device_type == "cuda":
        return Invariance(False, CUDA_AUTO)
    parts = cost()
    measured = max(parts.values(), default=0.0)
    verdict = "on" if measured <= MAX_COST else "off"
    each = ", ".join(f"{part} {100 * c:.1f}%" for part, c in parts.items())
    reason = (
        f"auto: {verdict}, its measured cost is {100 * measured:.1f}% on this CPU's decode kernels "
        f"({each or 'nothing to time'}; on up to {100 * MAX_COST:.0f}%)"
    )
    return Invariance(verdict == "on", reason, measured)


def with_engine_backends(
    invariance: Invariance, mode: str, named: Mapping[str, str | None], device_type: str = "cpu"
) -> Invariance:
    """`invariance` (decided at load for the model's kernels) held against the attention and
    SGMV backends the engine's config or environment names: ValueError for `on` with one
    that is not batch-invariant; `auto` turns off, saying why. A backend named is the reason
    given also where auto's measured cost had turned it off already (the reason that holds
    on every CPU, not a timing's); a load-time blocker (device, dtype) stays the reason."""
    measured = invariance.on or invariance.cost is not None
    blocker = _blocker(device_type, True, named) if measured else ""
    if not blocker:
        return invariance
    if mode == "on":
        raise ValueError(f"batch_invariant=on cannot hold: {blocker}; use off or auto")
    return Invariance(False, f"auto: off, {blocker}", invariance.cost)


def invariant_backend(device_type: str, kind: str) -> str:
    """The backend of `kind` ("dense", "fused", "attention", "SGMV") that computes
    batch-invariantly on `device_type` (a CPU's for a device without its own)."""
    default = INVARIANT_BACKENDS.get((device_type, None), INVARIANT_BACKENDS[("cpu", None)])
    return INVARIANT_BACKENDS.get((device_type, kind), default)


def _blocker(device_type: str, kernels: bool, named: Mapping[str, str | None]) -> str:
    if device_type not in ("cpu", "cuda"):
        return f"no batch-invariant kernels on {device_type} yet"
    if not kernels:
        if device_type == "cuda":
            return "the Triton kernels do not run this model here (Triton missing, or the dtype)"
        return "the compiled CPU kernels do not run this model here (untuned CPU or dtype)"
    others = {
        kind: name
        for kind, name in named.items()
        if name and name != invariant_backend(device_type, kind)
    }
    return ", ".join(
        f"{kind} backend {name!r} named, not the batch-invariant "
        f"{invariant_backend(device_type, kind)!r}"
        for kind, name in sorted(others.items())
    )


def backend_name(
    name: str | None, on: bool, device_type: str = "cpu", kind: str = ""
) -> str | None:
    """The backend of a kind to ask for: the batch-invariant one where the mode is on, else
    `name` (the one named, or None to choose)."""
    return invariant_backend(device_type, kind) if on else name


def relative_cost(timings: list[tuple[int, Mapping[str, float]]]) -> float:
    """The mode's cost on one part: (count, {backend: ms}) per shape, as autotune timed the
    candidates, the mode's own under the CPU's name (INVARIANT_BACKENDS); sum of count x its
    time over sum of count x the fastest's, minus 1 (0 where every shape is fastest in the
    mode's or had no timing)."""
    ours = best = 0.0
    mine = invariant_backend("cpu", "dense")
    for count, times in timings:
        if not times or mine not in times:
            continue
        ours += count * times[mine]
        best += count * min(times.values())
    return ours / best - 1.0 if best > 0 else 0.0
