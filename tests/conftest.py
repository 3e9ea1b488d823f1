"""Suite-wide settings: `gpu` tests skip without CUDA (`triton` and `device_pair` ones run on
the CPU then: in Triton's interpreter, CPU against CPU); `slow` ones still run in make test;
`long` ones (minutes each: the 20-kill Ray run) only when asked for, `-m long` or
`make test-long`."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton's kernels run in its interpreter (triton_interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the suite's servers and runners keep the CPUs busy: a first load times the batch-invariant
# mode's cost at once (kept as provisional) instead of waiting for a quiet machine
os.environ.setdefault("PUNICA_X_QUIET_WAIT", "0")
from helpers import CPU_ISAS, make_peft_adapter, make_tiny_llama


def pytest_collection_modifyitems(config, items):
    if "long" not in (config.getoption("markexpr") or ""):
        kept = [item for item in items if "long" not in item.keywords]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if "long" in i.keywords])
            items[:] = kept
    if torch.cuda.is_available():  # the Triton kernels' tests run on the GPU, with -m gpu too
        for item in items:  # and so do the CUDA-against-CPU engine tests
            if "triton" in item.keywords or "device_pair" in item.keywords:
                item.add_marker(pytest.mark.gpu)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request) -> str:
    """An instruction-set level whose kernel builds the test runs (avx2, avx512, avx512_bf16)."""
    return request.param


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for the whole test session (no dashboard), shut down at its end."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Adapters of ranks 4/8/16/64 on different target sets for the tiny model."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-adapters")
    specs = {
        "r4": (4, ["q_proj", "v_proj"]),
        "r8": (8, ["k_proj", "o_proj", "down_proj"]),
        "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        "r64": (64, ["gate_proj", "up_proj"]),
    }
    out = {}
    for seed, (name, (rank, targets)) in enumerate(specs.items()):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        out[name] = make_peft_adapter(base, root / name, rank, targets, seed=100 + seed)
    return out
