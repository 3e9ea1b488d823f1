"""A tiny registry of pluggable backends (STYLE habit 7): named factories imported lazily,
chosen by an explicit name, else an environment variable, else by device and dtype. A
backend is made once; a choice that cannot run raises instead of falling back silently."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

from punica_x.env import EnvVar

T = TypeVar("T")

Rule = Callable[[torch.device, "torch.dtype | None"], str]


def cpu_float32_else_torch(device: torch.device, dtype: torch.dtype | None) -> str:
    """Static default of the float32-only CPU kernels: "cpu" for float32 on a CPU they are
    tuned for (x86 AVX2 / AVX-512), else "torch". Timing at first load (autotune) refines it."""
    from punica_x.ops import isa

    cpu32 = device.type == "cpu" and dtype == torch.float32
    return "cpu" if cpu32 and isa.tuned() else "torch"


class Registry(Generic[T]):
    def __init__(
        self,
        kind: str,
        env: EnvVar,
        factories: dict[str, Callable[[], T]],
        default: Rule,
        needs: dict[str, tuple[str, torch.dtype | None]] | None = None,
    ) -> None:
        """needs[name] = (device type, dtype or None): where that backend can run."""
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
            device_type, need_dtype = self.needs[name]
            if device.type != device_type or (
                need_dtype is not None and dtype not in (None, need_dtype)
            ):
                what = f"{need_dtype} on {device_type}" if need_dtype else device_type
                raise ValueError(
                    f"the {name} {self.kind} backend needs {what}, not {dtype} on {device}"
                )
        if name not in self._made:
            self._made[name] = self.factories[name]()
        return self._made[name]
