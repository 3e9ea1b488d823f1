"""vLLM's --max-loras / --max-cpu-loras as byte budgets (punica_x/lora/slots.py): a slot is
an adapter of max_lora_rank on every projection of every layer; the counts replace the byte
budgets they are given for, the others stay; bad counts are refused."""

from __future__ import annotations

import dataclasses

import pytest

from punica_x.config import EngineConfig, GiB, LoraConfig
from punica_x.lora.peft_checks import LoraTarget
from punica_x.lora.slots import slot_bytes, with_slots

TARGET = LoraTarget(2, {"q_proj": (64, 64), "k_proj": (64, 16), "down_proj": (128, 64)})


def test_a_slot_is_a_max_rank_adapter_on_every_projection():
    # per layer: 8 x ((64 + 64) + (64 + 16) + (128 + 64)) = 3200 values; 2 layers; 2 bytes each
    assert slot_bytes(TARGET, 8, 2) == 2 * 3200 * 2


def test_counts_replace_the_budgets_they_are_given_for(caplog):
    each = slot_bytes(TARGET, 16, 4)
    base = EngineConfig(lora=LoraConfig(max_lora_rank=16, max_loras=5))
    with caplog.at_level("INFO", logger="punica_x.lora"):
        lora = with_slots(base, TARGET, 4).lora
    assert (lora.device_bytes, lora.host_bytes) == (5 * each, 4 * GiB)
    assert "max_loras: 5 adapters of rank 16" in caplog.text
    both = dataclasses.replace(base, lora=dataclasses.replace(base.lora, max_cpu_loras=7))
    assert with_slots(both, TARGET, 4).lora.host_bytes == 7 * each
    plain = EngineConfig()
    assert with_slots(plain, TARGET, 4) is plain


@pytest.mark.parametrize("bad", [0, -1, 100_001, True, 1.5, "8"])
@pytest.mark.parametrize("field", ["max_loras", "max_cpu_loras"])
def test_bad_counts_are_refused(field, bad):
    with pytest.raises(ValueError, match=field):
        LoraConfig(**{field: bad})
