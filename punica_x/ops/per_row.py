"""Torch computations of a step made batch-invariant (ops.invariance) by running them a row
at a time: what torch would otherwise compute differently by the row count or a row's place.

* A product of [rows, k] by a weight: a GEMM library blocks it, and splits its sums, by the
  row count; a one-row product sums each output in one order.
* A transcendental element-wise op over a tensor whose row is narrower than a vector (a
  [rows, 1] gate): torch computes the elements of its vectorized body with a SIMD
  approximation and the tail with the scalar function, and which elements fall in the tail
  depends on the row count (torch.sigmoid differs on ~4% of float32 inputs here). A
  one-row call of a [1, n] tensor puts the same elements in the same places every time.

Both cost a torch call per row, paid only in the mode and only where these parts run (an
adapter with LoRA on an edge or the router; a shared expert's gate). Measured on a 2-core
AVX2 EPYC, float32, per layer at 32 rows: a router LoRA delta ([32, 2048] @ [2048, 16] @
[16, 60]) 0.52 ms a row at a time against 0.05 ms batched; the [32, 1] sigmoid 0.19 ms
against 0.004 ms. At 256 rows (a prefill chunk): 3.5 ms against 0.19 ms, and 1.0 ms against
0.002 ms."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fixed_order: bool):
    """fn(x) for x [rows, ...]; fixed_order: fn of each row alone ([1, ...]), concatenated,
    so a row's result is the same whatever the rows around it."""
    if not fixed_order or x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


def products(x: torch.Tensor, mats: list[torch.Tensor], fixed_order: bool) -> torch.Tensor:
    """x @ mats[0] @ mats[1] ... ([rows, k] -> [rows, n]); fixed_order: a row at a time."""

    def chain(part: torch.Tensor) -> torch.Tensor:
        for m in mats:
            part = part @ m
        return part

    return rows(chain, x, fixed_order)
