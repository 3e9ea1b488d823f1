"""A tiny registry of pluggable backends (STYLE habit 7): named factories imported lazily,
chosen by an explicit name, else an environment variable, else by device and dtype. A
backend is made once; a choice that cannot run raises instead of falling back silently."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from punica_x.dtypes import dtype_name
from punica_x.env import EnvVar

T = TypeVar("T")

Rule = Callable[[torch.device, "torch.dtype | None"], str]


# The dtypes the compiled CPU kernels (csrc: dense, SGMV, attention, fused layers) take.
CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# ... and the batch-invariant Triton kernels on CUDA (ops.triton_gemm, ops.triton_norm,
# attention.triton_paged)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cpu_kernels_else_torch(device: torch.device, dtype: torch.dtype | None) -> str:
    """Static default of the compiled CPU kernels: "cpu" for float32 or bfloat16 on a CPU
    they are tuned for (x86 AVX2 / AVX-512), else "torch". Timing at first load (autotune)
    refines it."""
    from punica_x.ops import isa

    ours = device.type == "cpu" and dtype in (None, *CPU_KERNEL_DTYPES)
    return "cpu" if ours and isa.tuned() else "torch"


class Registry(Generic[T]):
    def __init__(
        self,
        kind: str,
        env: EnvVar,
        factories: dict[str, Callable[[], T]],
        default: Rule,
        needs: dict[str, tuple[str, torch.dtype | None]] | None = None,
    ) -> None:
        """needs[name] = (device type, dtypes): where that backend can run (dtypes: a dtype,
        a tuple of them, or None for any)."""
        self.kind, self.env, self.factories, self.default = kind, env, factories, default
        self.needs = needs or {}
        self._made: dict[str, T] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.factories)

    def get(
        self, device: torch.device | str, dtype: torch.dtype | None = None, name: str | None = None
    ) -> T:
        device = torch.device(device)
        name = name or self.env.get() or self.default(device, dtype)
        if name not in self.factories:
            raise ValueError(f"unknown {self.kind} backend {name!r}; choose one of {self.names}")
        if name in self.needs:
            device_type, dtypes = self.needs[name]
            if isinstance(dtypes, torch.dtype):
                dtypes = (dtypes,)
            if device.type != device_type or (
                dtypes is not None and dtype is not None and dtype not in dtypes
            ):
                takes = " or ".join(dtype_name(d) for d in dtypes) if dtypes else "any dtype"
                got = dtype_name(dtype) if dtype is not None else "any dtype"
                raise ValueError(
                    f"the {name} {self.kind} backend runs {takes} on {device_type}, "
                    f"not {got} on {device}"
                )
        if name not in self._made:
            self._made[name] = self.factories[name]()
        return self._made[name]
