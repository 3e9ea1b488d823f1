"""The process side of a Ray runner: a RunnerCore (runner_core.py: an Engine on its
AsyncEngine thread, the calls and the polled events) inside an async Ray actor. The
scheduler's side is scheduler/runners/ray_runner.py (RayRunner); the DistKV and DGFM methods
come from scheduler/distkv/actor.py."""

from __future__ import annotations

import os
from pathlib import Path

from punica_x.api import AdapterInfo, EngineConfig
from scheduler.distkv.actor import KVActorMethods
from scheduler.runners.runner_core import RunnerCore

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class RunnerActor(RunnerCore, KVActorMethods):
    """Runs in the actor's process (an async actor: its methods share one event loop)."""

    def __init__(self, config: EngineConfig, runner_id: str) -> None:
        import tempfile

        import torch

        from punica_x.api import Engine
        from scheduler.lamina.ray_workers import ray_attention_launcher

        # Ray starts actors with OMP_NUM_THREADS=1; a runner wants every core it was given
        # (the thread backend's default too), or PUNICA_X_RUNNER_THREADS when set.
        threads = int(os.environ.get("PUNICA_X_RUNNER_THREADS", 0)) or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        # attention workers as detached actors: they outlive this process, with its KV
        self.launcher = ray_attention_launcher(config, runner_id, threads)
        self._start(Engine(config, attention_launcher=self.launcher), runner_id)
        self.adapter_dir = Path(tempfile.mkdtemp(prefix=f"punica-x-{runner_id}-adapters-"))
        self.uploads = 0

    def lamina_workers(self):
        """Where this model worker's attention workers are (rescue.LaminaWorkers), None
        without them: the scheduler keeps it, to take their KV should this process die."""
        return self.launcher.describe() if self.launcher is not None else None

    def register_adapter(
        self,
        name: str,
        files: dict[str, bytes],
        sha256: str | None,
        version: int | None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        self.uploads += 1  # (a folder per upload: a held version keeps its files)
        folder = self.adapter_dir / f"{abs(hash(name))}-{self.uploads}"
        folder.mkdir(parents=True, exist_ok=True)
        for fname in ADAPTER_FILES:
            (folder / fname).write_bytes(files[fname])
        return self.engine.adapters.register(name, folder, sha256, version, pinned)

    def shutdown(self) -> None:
        import shutil

        self.async_engine.shutdown()
        if getattr(self, "kv_server", None) is not None:
            self.kv_server.close()
            self.borrower.close()
        shutil.rmtree(self.adapter_dir, ignore_errors=True)
