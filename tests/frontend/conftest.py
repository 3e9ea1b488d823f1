"""Fixtures: one real server (tiny model with a 4096-token context) shared by the frontend
tests, and two small adapters for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_llama
from live_server import start_server


@pytest.fixture(scope="session")
def srv_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with a 4096-token context, so requests can run long enough to be
    disconnected, cancelled or limited while they stream (~2 ms per token)."""
    return make_tiny_llama(tmp_path_factory.mktemp("srv-model"), max_position_embeddings=4096)


@pytest.fixture(scope="session")
def server(srv_model_dir, tmp_path_factory):
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("srv") / "data",
        "--limit",
        "max_upload_bytes=4000000",
        "--limit",
        "max_unpacked_bytes=3000000",
        "--limit",
        "max_tokens=4000",
        "--limit",
        "max_streams_per_key=2",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def adapter_dirs(srv_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Two small adapters (rank 4 and 8) for the tiny model."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("srv-adapters")
    base = AutoModelForCausalLM.from_pretrained(srv_model_dir, dtype=torch.float32)
    return {
        "a": make_peft_adapter(base, root / "a", 4, ["q_proj", "v_proj"], seed=1),
        "b": make_peft_adapter(base, root / "b", 8, ["o_proj", "down_proj"], seed=2),
    }
