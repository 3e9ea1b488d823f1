"""bench_adapters' object store: moto's standalone S3 server in a process of its own (so its
work is not the clients' interpreter's), filled with random PEFT adapters of mixed ranks for
the default model, one "folder" PREFIX/<tenant>/a<i>/ each, as a platform keeps its tenants'
fine-tunes. Objects over 64 KiB live in temporary files under the run's scratch folder (moto
keeps smaller ones in memory): 10,000 adapters are tens of GB.

Adapters are written without peft's model: a LoRA's A ~ U(-1/sqrt(in), 1/sqrt(in)) and B ~
N(0, 0.01), bfloat16, on the targets given (peft's default for Llama: q_proj, v_proj), with
the adapter_config.json peft writes for that rank (alpha = 2 rank)."""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "adapters"
PREFIX = "root"
SPILL_BYTES = 64 << 10  # moto keeps an object in memory up to this, then in a temp file


@dataclass(frozen=True)
class Shapes:
    """(fan_in, fan_out) of each targeted projection of one decoder layer, and the layers."""

    projections: dict[str, tuple[int, int]]
    layers: int


def model_shapes(hf_config, targets: list[str]) -> Shapes:
    """The default Llama layout's projections from its HF config."""
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, hf_config.num_key_value_heads * head_dim
    attn = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    mlp = {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    every = {f"self_attn.{k}": v for k, v in attn.items()} | {f"mlp.{k}": v for k, v in mlp.items()}
    chosen = {k: v for k, v in every.items() if k.rsplit(".", 1)[1] in targets}
    if len(chosen) != len(targets):
        raise ValueError(f"unknown targets in {targets}")
    return Shapes(chosen, hf_config.num_hidden_layers)


def draw_ranks(n: int, ranks: list[int], weights: list[float], seed: int) -> list[int]:
    """Each adapter's rank, drawn independently of its popularity (seeded)."""
    return random.Random(seed).choices(ranks, weights=weights, k=n)


def config_json(rank: int, targets: list[str]) -> bytes:
    """adapter_config.json as peft's save_pretrained writes it for this rank."""
    from peft import LoraConfig

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets).to_dict()
    cfg = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}
    return json.dumps(cfg, indent=2, sort_keys=True).encode()


def weights_bytes(shapes: Shapes, rank: int, seed: int) -> bytes:
    """adapter_model.safetensors of one random adapter."""
    from safetensors.torch import save

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.layers):
        for proj, (fan_in, fan_out) in shapes.projections.items():
            stem = f"base_model.model.model.layers.{layer}.{proj}"
            a = torch.empty(rank, fan_in, dtype=torch.bfloat16).uniform_(
                -(fan_in**-0.5), fan_in**-0.5, generator=gen
            )
            b = torch.empty(fan_out, rank, dtype=torch.bfloat16).normal_(0.0, 0.01, generator=gen)
            tensors[f"{stem}.lora_A.weight"] = a
            tensors[f"{stem}.lora_B.weight"] = b
    return save(tensors, metadata={"format": "pt"})


class AdapterStore:
    """moto's server on 127.0.0.1:port with BUCKET; stop() ends it (and its temp files)."""

    def __init__(self, scratch: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        spill = scratch / "moto"
        spill.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(SPILL_BYTES), TMPDIR=str(spill))
        self.log = (scratch / "moto.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_more_files,
        )
        self._wait()
        self.client = self._client()
        self.client.create_bucket(Bucket=BUCKET)

    def environment(self) -> dict[str, str]:
        """The AWS environment a server reading this store runs with."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url}

    def fill(self, tenant: str, ranks: list[int], shapes: Shapes, targets: list[str]) -> int:
        """Put adapter a<i> of rank ranks[i] under PREFIX/tenant/; returns the bytes stored."""
        configs = {r: config_json(r, targets) for r in set(ranks)}

        def put(i: int) -> int:
            weights = weights_bytes(shapes, ranks[i], seed=10_000 + i)
            folder = f"{PREFIX}/{tenant}/a{i}"
            self.client.put_object(Bucket=BUCKET, Key=f"{folder}/adapter_config.json",
                                   Body=configs[ranks[i]])  # fmt: skip
            self.client.put_object(Bucket=BUCKET, Key=f"{folder}/adapter_model.safetensors",
                                   Body=weights)  # fmt: skip
            return len(weights) + len(configs[ranks[i]])

        with ThreadPoolExecutor(4) as pool:
            return sum(pool.map(put, range(len(ranks))))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()

    def _wait(self, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto's server exited ({self.proc.returncode})")
            try:
                httpx.get(self.url + "/moto-api/", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"moto's server did not answer in {seconds} s")

    def _client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            config=Config(max_pool_connections=8),
        )


def _more_files() -> None:
    """Every spilled object is an open temporary file in moto's process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
