"""The scheduler's adapter registry: which adapters every runner holds, and their versions.

An adapter is registered under the key the frontend chooses (tenant-scoped) on every live
runner at once; a runner that refuses it (bad files, no room) makes the registration fail
as a whole: the runners that took it go back to what they held before (the previous files
under that key, or nothing), so no runner serves an adapter the others do not. A runner that
starts later gets every current adapter before it takes work (`install`).

Versions: each registration gets one scheduler version (returned in the AdapterInfo);
runners number their own versions independently, and `has_version` answers for the
scheduler's (whether any live runner still holds it, current or in use by a request)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Iterable
from pathlib import Path

from punica_x.lora.pool import AdapterInfo, UnknownAdapterError

log = logging.getLogger(__name__)


class AdapterRegistry:
    def __init__(self) -> None:
        self.files: dict[str, tuple[Path, str | None]] = {}  # key -> (directory, sha256)
        self._ids = itertools.count(1)
        self._current: dict[str, int] = {}  # key -> its current scheduler version
        # scheduler version -> runner id -> that runner's own version of the same files
        self._versions: dict[int, dict[str, int]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.files

    async def register(
        self, key: str, path: Path, sha256: str | None, runners: Iterable
    ) -> AdapterInfo:
        """Register on every runner in `runners` (handles) concurrently; the first refusal is
        raised after the others are rolled back."""
        runners = list(runners)
        results = await asyncio.gather(
            *(h.register_adapter(key, path, sha256) for h in runners), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, BaseException)]
        if refused:
            took = [h for h, r in zip(runners, results) if not isinstance(r, BaseException)]
            await self._roll_back(key, took)
            raise refused[0]
        self.files[key] = (path, sha256)
        version = next(self._ids)
        self._versions[version] = {h.runner_id: info.version for h, info in zip(runners, results)}
        self._current[key] = version
        return dataclasses.replace(results[0], version=version)

    async def _roll_back(self, key: str, took: list) -> None:
        """The runners in `took` registered `key` anew: they go back to its previous files, or
        drop it when there were none."""
        previous = self.files.get(key)
        version = self._current.get(key)
        for h in took:
            try:
                if previous is None:
                    await h.unregister_adapter(key)
                else:
                    info = await h.register_adapter(key, *previous)
                    if version in self._versions:
                        self._versions[version][h.runner_id] = info.version
            except Exception:
                log.exception("rolling back adapter %s on runner %s failed", key, h.runner_id)

    async def unregister(self, key: str, runners: Iterable) -> None:
        """Drop `key` here and on every runner; UnknownAdapterError when a runner did not
        hold it (raised once every runner was asked)."""
        self.files.pop(key, None)
        self._current.pop(key, None)
        missing = None
        for h in runners:
            try:
                await h.unregister_adapter(key)
            except UnknownAdapterError as exc:
                missing = exc
        if missing is not None:
            raise missing

    async def install(self, handle) -> None:
        """Every current adapter on a runner that is starting (one after another)."""
        for key, (path, sha256) in list(self.files.items()):
            info = await handle.register_adapter(key, path, sha256)
            version = self._current.get(key)
            if version in self._versions:
                self._versions[version][handle.runner_id] = info.version

    def has_version(self, version: int, runners: Iterable) -> bool:
        """Whether any of the live `runners` still holds this scheduler version. A version no
        runner holds is forgotten (it can never be held again)."""
        per_runner = self._versions.get(version, {})
        held = any(
            h.has_version(per_runner[h.runner_id]) for h in runners if h.runner_id in per_runner
        )
        if not held and self._current.get(self._key_of(version)) != version:
            self._versions.pop(version, None)
        return held

    def _key_of(self, version: int) -> str | None:
        return next((k for k, v in self._current.items() if v == version), None)
