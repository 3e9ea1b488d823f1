"""First-load timing of interchangeable backends, cached per machine.

A backend kind (dense, fused, attention, SGMV) with no backend named by the caller or its
$PUNICA_X_*_BACKEND variable is chosen by timing every candidate that can run on the model's
actual shapes: choose() runs each candidate's workload once to warm up, then times them in
turn, round-robin, `repeats` times or more (so a drift of the machine's speed hits all
candidates alike; time_round_robin) and keeps the one with the smallest median. Choices and
all timings are cached in <cache>/autotune/<fingerprint>.json, the fingerprint hashing the
CPU model and flags, the kernels' ISA level, torch's version and ISA limits, the thread
count and the kernel sources, so another machine, thread count or kernel version never
reuses a stale choice. Every choice is logged (INFO, logger punica_x.autotune) with its
timings; a candidate that fails to set up is logged (WARNING) and left out.
$PUNICA_X_AUTOTUNE=0 turns timing off (static defaults).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from punica_x.env import AUTOTUNE, cache_dir
from punica_x.ops import isa as isa_mod

log = logging.getLogger("punica_x.autotune")

# A candidate: setup() -> run(); setup may build/pack (untimed), run() is the timed workload.
Candidate = Callable[[], Callable[[], object]]
# Bumped whenever the timing workloads change, so no choice timed the old way is reused.
TIMING_VERSION = "3"
# time_round_robin: rounds of every candidate while they take under BUDGET_S in all
BUDGET_S, MAX_ROUNDS = 0.05, 400


@dataclass(frozen=True)
class Tuned:
    name: str
    timings_ms: dict[str, float]
    cached: bool


def enabled() -> bool:
    return AUTOTUNE.get().strip().lower() not in ("0", "false", "no", "off")


@cache
def _sources_hash() -> str:
    from punica_x.ops._build import CSRC_ROOT

    h = hashlib.sha256()
    for path in sorted(CSRC_ROOT.rglob("*")):
        if path.is_file() and path.suffix in (".h", ".cpp", ".cu"):
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


def fingerprint() -> str:
    parts = (
        TIMING_VERSION,
        isa_mod.cpu_model(),
        " ".join(sorted(isa_mod.cpu_flags())),
        isa_mod.resolve(),
        torch.__version__,
        str(torch.get_num_threads()),
        _sources_hash(),
        # torch's own ISA limits (a held level sets them: isa.hold_libraries; a user may too):
        # oneDNN's and ATen's kernels, the candidates timed beside ours, change with them
        *(f"{name}={os.environ.get(name, '')}" for name in isa_mod.LIBRARY_ISA_VARIABLES),
    )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _path() -> Path:
    return cache_dir("autotune") / f"{fingerprint()}.json"


_memory: dict[str, dict] = {}


def _lookup(key: str) -> dict | None:
    path = _path()
    entry = _memory.get(f"{path}:{key}")
    if entry is None and path.exists():
        try:
            entry = json.loads(path.read_text()).get(key)
        except (OSError, ValueError):
            entry = None
    return entry


def recall(key: str) -> dict | None:
    """What remember() kept under `key` for this machine and kernel build (fingerprint)."""
    return _lookup(key)


def remember(key: str, entry: dict) -> None:
    """Keep a JSON-able `entry` under `key` beside this machine's timings."""
    _store(key, entry)


def forget(prefix: str) -> list[str]:
    """Drop this machine's entries whose key starts with `prefix`; the keys dropped."""
    path = _path()
    for k in [k for k in _memory if k.startswith(f"{path}:{prefix}")]:
        del _memory[k]
    gone: list[str] = []

    def drop(data: dict) -> None:
        gone.extend(k for k in data if k.startswith(prefix))
        for k in gone:
            del data[k]

    _update(path, drop)
    return gone


def _store(key: str, entry: dict) -> None:
    path = _path()
    _memory[f"{path}:{key}"] = entry

    def put(data: dict) -> None:
        data[key] = entry
        data.setdefault("_about", _about())

    _update(path, put)


def _update(path: Path, change: Callable[[dict], None]) -> None:
    """Read the file under its lock (another process may time at once), change its data in
    place, and write it back whole (a temporary file renamed over it)."""
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(path.read_text()) if path.exists() else {}
        except (OSError, ValueError):
            data = {}
        change(data)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)


def _about() -> dict:
    return {
        "cpu": isa_mod.cpu_model(),
        "isa": isa_mod.resolve(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def time_round_robin(
    runs: Mapping[str, Callable[[], object]], repeats: int, budget_s: float = BUDGET_S
) -> dict[str, float]:
    """Median milliseconds of each run() (after one untimed warm-up each), timed in turn,
    round after round: at least `repeats` rounds, more while the rounds took under budget_s
    (up to MAX_ROUNDS), so a workload of microseconds gets a median of hundreds of runs."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    began, rounds = time.perf_counter(), 0
    while rounds < repeats or (rounds < MAX_ROUNDS and time.perf_counter() - began < budget_s):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
        rounds += 1
    return {name: round(statistics.median(t) * 1e3, 4) for name, t in times.items()}


def dtype_suffix(dtype: torch.dtype) -> str:
    """What a timing key adds for its dtype ("" for float32, so float32 keys stay as they were)."""
    return "" if dtype == torch.float32 else f" dtype={str(dtype).removeprefix('torch.')}"


def choose(
    kind: str, key: str, candidates: Mapping[str, Candidate], repeats: int = 7, fresh: bool = False
) -> Tuned:
    """The fastest candidate for (kind, key), from the cache or timed now (a lone candidate
    is taken without timing); fresh: timed now whatever the cache holds (and cached)."""
    if len(candidates) == 1:
        return Tuned(next(iter(candidates)), {}, cached=False)
    full = f"{kind}:{key}"
    entry = None if fresh else _lookup(full)
    if entry is not None and entry.get("name") in candidates:
        return Tuned(entry["name"], entry["timings_ms"], cached=True)
    runs: dict[str, Callable[[], object]] = {}
    for name, setup in candidates.items():
        try:
            runs[name] = setup()
        except Exception as exc:  # a backend this machine cannot run is left out, loudly
            log.warning("%s %s: candidate %s cannot run here: %s", kind, key, name, exc)
    if not runs:
        raise RuntimeError(f"{kind} {key}: no candidate backend could run")
    timings = time_round_robin(runs, repeats)
    best = min(timings, key=timings.__getitem__)
    _store(full, {"name": best, "timings_ms": timings})
    log.info(
        "%s %s: %s (%s)",
        kind,
        key,
        best,
        ", ".join(f"{n} {t:.3f} ms" for n, t in sorted(timings.items(), key=lambda kv: kv[1])),
    )
    return Tuned(best, timings, cached=False)
