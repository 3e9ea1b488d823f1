"""The segments and LoRA weights of one SGMV launch (layouts in punica_x/ops/sgmv.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

# Segments of at most this many rows have their weights prefetched by the dense GEMM before
# the launch (prefetch_spans). A one-row segment reads each weight for one row: memory-bound,
# and the GEMM, compute-bound at decode batch sizes, leaves memory idle (32 one-row segments,
# SmolLM2 bf16, AMD EPYC Zen 4: dense + LoRA 0.82x). At 4 rows the launch reuses each weight
# enough that prefetching bought nothing (1.01x), and for one 32-row segment it cost 1.02-1.06x.
PREFETCH_MAX_ROWS = 2


@dataclass(frozen=True, eq=False)
class SgmvWeights:
    """Segments and the LoRA weights one SGMV launch reads (built once per step, read per layer).

    seg:      [S + 1] int32 on the device, first row of each segment
    seg_host: the same offsets as a tuple (for the reference and for sizing)
    ranks:    [S, n_slices] int32 on the device (ranks_host: tuple of tuples)
    a, b:     per segment the adapter's tensors (layouts in the module doc), None for no adapter;
              held here so the addresses in a_ptr / b_ptr stay valid
    a_ptr, b_ptr: [S] int64 addresses of a[s] / b[s] (0 for None)
    h_out:    output width of each slice
    max_rows: rows of the longest segment with an adapter; max_rank: largest sum_j ranks[s, j]
    weight_dtype: the adapters' dtype (one for all), None for x's (no adapter, or a launch
              built without it): the CPU kernels also take bfloat16 weights with float32 x
    static:   the device tables are rewritten in place between launches (a CUDA graph's
              buffers, engine/cuda_graphs.py): every launch reads them anew, never a copy
              bound once (on the CPU, bind() reads the tables when it is made)
    """

    seg: torch.Tensor
    seg_host: tuple[int, ...]
    ranks: torch.Tensor
    ranks_host: tuple[tuple[int, ...], ...]
    a: tuple[torch.Tensor | None, ...]
    b: tuple[torch.Tensor | None, ...]
    a_ptr: torch.Tensor
    b_ptr: torch.Tensor
    h_out: tuple[int, ...]
    max_rows: int
    max_rank: int
    static: bool = False
    weight_dtype: torch.dtype | None = None

    @property
    def num_segments(self) -> int:
        return len(self.seg_host) - 1

    def launch(self, backend):
        """backend.bind(self), made on first use and kept for the next calls with this backend
        (a step plan's weights serve every layer of every step the plan is reused):
        launch(y, x, v, layer) adds the LoRA of this launch's segments at `layer`."""
        kept = self.__dict__.get("_launch")
        if kept is None or kept[0] is not backend:
            bound = self._unbound(backend) if self.static else backend.bind(self)
            kept = (backend, bound)
            self.__dict__["_launch"] = kept
        return kept[1]

    def _unbound(self, backend):
        def launch(y, x, v, layer) -> None:
            backend.add_lora(y, x, v, self, layer)

        return launch

    @cached_property
    def prefetch_spans(self) -> torch.Tensor | None:
        """[L, 2 * A, 2] int64 on the CPU: per layer, the (address, bytes) of the A rows and
        the B rows at that layer of each of the A segments with an adapter and at most
        PREFETCH_MAX_ROWS rows. A dense GEMM prefetches them while it computes, before the
        launch at that layer reads them (csrc/common/prefetch.h). Built on first use, once
        per step; None when no segment qualifies."""
        rows = [b - a for a, b in zip(self.seg_host, self.seg_host[1:])]
        pairs = [
            (a, b)
            for a, b, n in zip(self.a, self.b, rows)
            if a is not None and 0 < n <= PREFETCH_MAX_ROWS
        ]
        if not pairs:
            return None
        layers = pairs[0][0].shape[0]
        base = torch.tensor(
            [[t.data_ptr(), t[0].nbytes] for pair in pairs for t in pair], dtype=torch.int64
        )
        spans = base.unsqueeze(0).repeat(layers, 1, 1)
        spans[:, :, 0] += torch.arange(layers, dtype=torch.int64).unsqueeze(1) * base[:, 1]
        return spans

    @cached_property
    def prefetch_layers(self) -> tuple[torch.Tensor, ...] | None:
        """prefetch_spans split by layer ([2 * A, 2] each; a tuple, indexed by every LoRA
        projection of every layer, where indexing the tensor made a new view per call)."""
        spans = self.prefetch_spans
        return None if spans is None else tuple(spans.unbind(0))

    @classmethod
    def build(
        cls,
        seg: Sequence[int],
        a: Sequence[torch.Tensor | None],
        b: Sequence[torch.Tensor | None],
        ranks: Sequence[Sequence[int]],
        h_out: Sequence[int],
        device: torch.device | str,
    ) -> SgmvWeights:
        """Check shapes and pack pointers. ``seg`` has S + 1 entries; the others S each."""
        n = len(seg) - 1
        if not (len(a) == len(b) == len(ranks) == n):
            raise ValueError(f"need {n} entries of a, b, ranks for {n} segments")
        h_out = tuple(int(h) for h in h_out)
        ranks = tuple(tuple(int(r) for r in rs) for rs in ranks)
        for s in range(n):
            _check_segment_weights(s, a[s], b[s], ranks[s], h_out)
            if seg[s + 1] < seg[s]:
                raise ValueError(f"seg must be non-decreasing, got {list(seg)}")
        with_adapter = [s for s in range(n) if a[s] is not None]
        shapes = {(a[s].shape[0], a[s].shape[2]) for s in with_adapter}  # (layers, h_in)
        if len(shapes) > 1:
            raise ValueError(f"one launch's adapters must share layers and h_in, got {shapes}")
        dtypes = {t.dtype for s in with_adapter for t in (a[s], b[s])}
        if len(dtypes) > 1:
            raise ValueError(
                f"one launch's adapters must share one dtype, got {sorted(map(str, dtypes))}"
            )
        max_rows = max((seg[s + 1] - seg[s] for s in with_adapter), default=0)
        max_rank = max((sum(ranks[s]) for s in with_adapter), default=0)
        rank_rows = ranks if n else ((0,) * len(h_out),)
        return cls(
            seg=torch.tensor(seg, dtype=torch.int32, device=device),
            seg_host=tuple(int(x) for x in seg),
            ranks=torch.tensor(rank_rows, dtype=torch.int32, device=device)[:n],
            ranks_host=ranks,
            a=tuple(a),
            b=tuple(b),
            a_ptr=_pointers(a, device),
            b_ptr=_pointers(b, device),
            h_out=h_out,
            max_rows=max_rows,
            max_rank=max_rank,
            weight_dtype=next(iter(dtypes), None),
        )


def _check_segment_weights(s, a, b, ranks, h_out) -> None:
    if (a is None) != (b is None):
        raise ValueError(f"segment {s}: a and b must both be given or both be None")
    if len(ranks) != len(h_out):
        raise ValueError(f"segment {s}: {len(ranks)} ranks for {len(h_out)} slices")
    if a is None:
        return
    rank = sum(ranks)
    if a.dim() != 3 or a.shape[1] != rank or not a.is_contiguous():
        raise ValueError(
            f"segment {s}: a must be contiguous [L, {rank}, h_in], got {tuple(a.shape)}"
        )
    width = sum(r * h for r, h in zip(ranks, h_out))
    if b.dim() != 2 or b.shape != (a.shape[0], width) or not b.is_contiguous():
        raise ValueError(
            f"segment {s}: b must be contiguous [{a.shape[0]}, {width}], got {tuple(b.shape)}"
        )


def _pointers(ws: Sequence[torch.Tensor | None], device) -> torch.Tensor:
    return torch.tensor(
        [0 if w is None else w.data_ptr() for w in ws], dtype=torch.int64, device=device
    )
