"""Fixtures: one real server (tiny model with a 4096-token context) shared by the frontend
tests, a second one with a tight KV cache and websocket frame cap, and two small adapters.
Both serve float32 (start_server's default): their tests compare with float32 HF references
and count float32 KV blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_llama
from live_server import TIGHT_KV_TOKENS, TIGHT_WS_FRAME_BYTES, start_server


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
def tight_server(srv_model_dir, tmp_path_factory):
    """The same model served with a KV cache of TIGHT_KV_TOKENS tokens (a few requests of
    ~75 tokens preempt each other; one of ~130 cannot fit even alone) and
    `--limit max_ws_frame_bytes=TIGHT_WS_FRAME_BYTES`."""
    srv = start_server(
        srv_model_dir,
        tmp_path_factory.mktemp("tight") / "data",
        "--limit",
        f"max_ws_frame_bytes={TIGHT_WS_FRAME_BYTES}",
        "--kv-cache-bytes",
        str(TIGHT_KV_TOKENS // 16 * 8192),  # 8 KiB a float32 block of the tiny model
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
