"""vLLM's adapter counts as punica-x's byte budgets: --max-loras N sizes the device pool to
hold N adapters of max_lora_rank on every projection of every layer, --max-cpu-loras M the
host cache to hold M of them (LoraConfig.max_loras / max_cpu_loras).

The pool itself stays budgeted in bytes (an adapter costs what its ranks and targets cost),
so N is a floor: adapters of a lower rank or on fewer projections fit more of them. Adapters
on a mixture of experts' experts or on the embeddings / lm_head cost more than a slot and
are counted at what they cost."""

from __future__ import annotations

import dataclasses
import logging

from punica_x.config import EngineConfig
from punica_x.lora.peft_checks import LoraTarget

log = logging.getLogger("punica_x.lora")


def slot_bytes(target: LoraTarget, rank: int, element_size: int) -> int:
    """Bytes of an adapter of `rank` on every projection (A [rank, in] and B [out, rank]) of
    every layer of the model `target` describes."""
    per_layer = sum(rank * (d_in + d_out) for d_in, d_out in target.shapes.values())
    return target.num_layers * per_layer * element_size


def with_slots(config: EngineConfig, target: LoraTarget, element_size: int) -> EngineConfig:
    """`config` with lora.device_bytes / host_bytes set from max_loras / max_cpu_loras (the
    ones not given unchanged), each logged with the bytes it stands for."""
    lora = config.lora
    if lora.max_loras is None and lora.max_cpu_loras is None:
        return config
    each = slot_bytes(target, lora.max_lora_rank, element_size)
    changes = {}
    for count, field in ((lora.max_loras, "device_bytes"), (lora.max_cpu_loras, "host_bytes")):
        if count is not None:
            changes[field] = count * each
            log.info(
                "%s: %d adapters of rank %d on every projection, %.1f MiB each -> %s %.1f MiB",
                "max_loras" if field == "device_bytes" else "max_cpu_loras",
                count,
                lora.max_lora_rank,
                each / (1 << 20),
                field,
                count * each / (1 << 20),
            )
    return dataclasses.replace(config, lora=dataclasses.replace(lora, **changes))
