"""The scheduler's adapter registry: which adapters every runner holds, and their versions.

An adapter is registered under the key the frontend chooses (tenant-scoped) on every live
runner at once; a runner that refuses it (bad files, no room) makes the registration fail
as a whole: the runners that took it go back to what they held before (the previous files
under that key, or nothing), so no runner serves an adapter the others do not. A runner that
starts later gets every current adapter before it takes work (`install`).

Versions: one id per registration, the same on every runner: the caller's (the server
passes the store's row id, so an upload has one id from the database to every pool), or,
when the caller names none, the next of the registry's own. `has_version` asks the runners
whether any still holds it (current, or in use by a request).

Pins (AdapterPool.pin): `pinned` True or False on a registration pins or unpins the key on
every runner (a registration of the version a runner holds changes only that); None keeps
what the key had. A runner that starts later gets the key's pin after its files, and a
runner that cannot hold the pin (a smaller pool) serves the key unpinned, logged."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from punica_x.api import AdapterError, AdapterInfo, UnknownAdapterError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registered:
    """What a key serves now: its files and their version id."""

    path: Path
    sha256: str | None
    version: int
    pinned: bool = False


class AdapterRegistry:
    def __init__(self) -> None:
        self.files: dict[str, Registered] = {}  # key -> what it serves
        self._ids = itertools.count(1)  # for registrations that name no version

    def version_of(self, key: str) -> int | None:
        """The version registered under `key`, None when nothing is."""
        registered = self.files.get(key)
        return registered.version if registered is not None else None

    def __contains__(self, key: str) -> bool:
        return key in self.files

    async def register(
        self,
        key: str,
        path: Path,
        sha256: str | None,
        runners: Iterable,
        version: int | None = None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        """Register on every runner in `runners` (handles) concurrently as `version` (None:
        the registry numbers it), pinned or unpinned as `pinned` says (None: as the key
        was); the first refusal is raised after the others are rolled back."""
        runners = list(runners)
        version = next(self._ids) if version is None else version
        results = await asyncio.gather(
            *(h.register_adapter(key, path, sha256, version, pinned) for h in runners),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, BaseException)]
        if refused:
            took = [h for h, r in zip(runners, results) if not isinstance(r, BaseException)]
            await self._roll_back(key, took)
            raise refused[0]
        previous = self.files.get(key)
        if pinned is None:
            pinned = previous.pinned if previous is not None else False
        self.files[key] = Registered(path, sha256, version, pinned)
        return results[0]

    async def _roll_back(self, key: str, took: list) -> None:
        """The runners in `took` registered `key` anew: they go back to its previous files
        (under their version), or drop it when there were none."""
        previous = self.files.get(key)
        for h in took:
            try:
                if previous is None:
                    await h.unregister_adapter(key)
                else:
                    await h.register_adapter(
                        key, previous.path, previous.sha256, previous.version, previous.pinned
                    )
            except Exception:
                log.exception("rolling back adapter %s on runner %s failed", key, h.runner_id)

    async def unregister(self, key: str, runners: Iterable) -> None:
        """Drop `key` here and on every runner; UnknownAdapterError when a runner did not
        hold it (raised once every runner was asked)."""
        self.files.pop(key, None)
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
        for key, reg in list(self.files.items()):
            await handle.register_adapter(key, reg.path, reg.sha256, reg.version)
            if reg.pinned:
                try:
                    await handle.register_adapter(key, reg.path, reg.sha256, reg.version, True)
                except AdapterError as exc:
                    log.warning(
                        "runner %s serves adapter %s unpinned: %s", handle.runner_id, key, exc
                    )

    @staticmethod
    def has_version(version: int, runners: Iterable) -> bool:
        """Whether any of the live `runners` still holds this version."""
        return any(h.has_version(version) for h in runners)
