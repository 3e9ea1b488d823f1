"""Which device each thread runner serves from (`punica-x serve --devices`): pure functions of
the visible devices, so tests run them anywhere.

The default is every visible GPU, one runner each (cuda:0, cuda:1, ...), else the CPU. A
runner's device is devices[i % len(devices)] for runner-i, so runners started later (admin
scale, autoscale, a replacement for a dead one) go round the same list. Thread runners on
one device share one copy of the weights; each device loads its own. Ray runners take one
GPU each from Ray, as before."""

from __future__ import annotations

import re

_CUDA = re.compile(r"^cuda:(\d{1,4})$")


def visible_devices(cuda_count: int) -> tuple[str, ...]:
    """The default list: every visible GPU, else the CPU."""
    return tuple(f"cuda:{i}" for i in range(cuda_count)) or ("cpu",)


def parse_devices(spec: str | None, cuda_count: int) -> tuple[str, ...]:
    """--devices: None or "auto" (visible_devices), "cpu", or a comma-separated list of
    cuda:N. ValueError naming the problem: a malformed or repeated entry, a GPU that is not
    visible, or the CPU mixed with GPUs."""
    if spec is None or spec.strip() == "auto":
        return visible_devices(cuda_count)
    if not isinstance(spec, str) or len(spec) > 4096:
        raise ValueError("devices must be auto, cpu or a list like cuda:0,cuda:1")
    items = [s.strip() for s in spec.split(",")]
    if items == ["cpu"]:
        return ("cpu",)
    out: list[str] = []
    for item in items:
        m = _CUDA.match(item)
        if m is None:
            raise ValueError(f"devices: {item!r} is not cpu or cuda:N (e.g. cuda:0,cuda:1)")
        if int(m.group(1)) >= cuda_count:
            raise ValueError(f"devices: {item} is not visible ({cuda_count} GPUs are)")
        if item in out:
            raise ValueError(f"devices: {item} is listed twice")
        out.append(item)
    return tuple(out)


def runner_index(runner_id: str) -> int:
    """N of a runner id "runner-N" (0 for other names)."""
    head, _, tail = runner_id.rpartition("-")
    return int(tail) if head and tail.isdigit() else 0


def device_of(runner_id: str, devices: tuple[str, ...]) -> str:
    """The device runner `runner_id` serves from."""
    return devices[runner_index(runner_id) % len(devices)]
