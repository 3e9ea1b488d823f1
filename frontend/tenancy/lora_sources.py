"""Where a tenant's adapters are loaded from by path (vLLM's dynamic LoRA API,
POST /v1/load_lora_adapter): a directory the operator names (serve --lora-source-root DIR)
holds one folder per tenant, DIR/<tenant name>/, and a tenant loads only from its own.

A `lora_path` is a path relative to the tenant's folder, an absolute path inside it, or a
file:// URI of one (no host); it names a PEFT directory holding adapter_config.json and
adapter_model.safetensors, which are then checked and stored as an upload's are. Refused
before anything is kept, each with a 4xx that says why: other URI schemes (an object store
is a root of its own: object_sources.py), paths that resolve outside the tenant's folder
(`..`, absolute paths elsewhere, symlinks pointing out), NUL bytes, files that are not
regular files (a FIFO would hang the read), files over the upload limits. A directory that
does not exist is 404, as vLLM answers it.

The check is made on the resolved path (links inside the folder are followed: a hub cache's
snapshots are links to its blobs), which is then opened without following a final symlink
(O_NOFOLLOW) and checked again on the open descriptor, so a file swapped for a link between
the check and the read is refused. Run it all off the event loop (a slow disk)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from frontend.config import Limits
from frontend.http.errors import ApiError, bad_request
from frontend.tenancy.source_files import SourceFiles, check_text
from frontend.tenancy.uploads import CONFIG, WEIGHTS


class LocalSource:
    """Tenants' adapter folders under a local root (this module); ObjectSource
    (object_sources.py) is the same for an object store."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def describe(self, tenant: str) -> str:
        return f"{tenant}/ under the server's --lora-source-root"

    def read(self, tenant: str, lora_path: str, limits: Limits) -> SourceFiles:
        check_text(lora_path)
        return SourceFiles(load_files(self.root, tenant, lora_path, limits), lora_path)


def open_source(root: Path | str | None, timeout_s: float = 15.0):
    """The source of --lora-source-root (a directory, or an object store's URI: parsed and
    checked at start); None when it is off."""
    if root is None:
        return None
    if isinstance(root, Path):
        return LocalSource(root)
    from frontend.tenancy.object_sources import ObjectSource, parse_root

    return ObjectSource(parse_root(root), timeout_s)


def tenant_folder(root: Path, tenant: str) -> Path:
    """The tenant's source folder, resolved (the operator may link it elsewhere; tenant
    names match NAME_PATTERN: no separators, no dot first)."""
    return (root.resolve() / tenant).resolve()


def resolve(root: Path, tenant: str, lora_path: str) -> Path:
    """The adapter directory `lora_path` names for `tenant`; ApiError when it is refused."""
    check_text(lora_path)
    path = _local_path(lora_path)
    folder = tenant_folder(root, tenant)
    try:
        target = (folder / path).resolve()  # an absolute `path` replaces the folder
        inside = target.is_relative_to(folder)
        is_dir = inside and target.is_dir()
    except (OSError, RuntimeError) as exc:  # a name too long, a loop of links
        raise bad_request(
            "invalid_lora_path", f"lora_path cannot be resolved: {_why(exc)}", "lora_path"
        ) from None
    if not inside:
        raise ApiError(
            403,
            "lora_path_forbidden",
            f"lora_path must be inside your source folder ({tenant}/ under the server's "
            "--lora-source-root)",
            "lora_path",
        )
    if not is_dir:
        raise ApiError(
            404, "lora_path_not_found", f"no adapter directory at {lora_path!r}", "lora_path"
        )
    return target


def _local_path(lora_path: str) -> Path:
    try:
        parts = urlsplit(lora_path) if "://" in lora_path else None
    except ValueError as exc:  # e.g. a bracketed host that is not an IPv6 address
        raise bad_request("invalid_lora_path", f"lora_path: {exc}", "lora_path") from None
    if parts is None:
        return Path(lora_path)
    if parts.scheme != "file":
        raise bad_request(
            "unsupported_source",
            f"lora_path scheme {parts.scheme!r} is not served: give a path inside your source "
            "folder (or a file:// URI of one)",
            "lora_path",
        )
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment or "\x00" in path:
        raise bad_request(
            "invalid_lora_path", "a file:// lora_path names a local path, no host", "lora_path"
        )
    return Path(path)


def read_adapter(directory: Path, folder: Path, limits: Limits) -> dict[str, bytes]:
    """The two PEFT files of `directory` (inside `folder`), each within its limit."""
    caps = {CONFIG: limits.max_config_bytes, WEIGHTS: limits.max_upload_bytes}
    return {name: _read_file(directory / name, folder, cap) for name, cap in caps.items()}


def _read_file(path: Path, folder: Path, cap: int) -> bytes:
    """A file linked inside the folder (a hub cache's snapshot links) is read where it points."""
    name = path.name
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as exc:
        raise bad_request("unreadable_file", f"{name} cannot be read: {_why(exc)}") from None
    if not real.is_relative_to(folder):
        raise ApiError(403, "lora_path_forbidden", f"{name} links outside your source folder")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise bad_request("missing_file", f"the adapter directory has no {name}") from None
    except OSError as exc:
        raise bad_request("unreadable_file", f"{name} cannot be read: {_why(exc)}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):  # a directory, a FIFO, a device
        os.close(fd)
        raise bad_request("not_a_file", f"{name} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > cap:
            raise ApiError(413, "payload_too_large", f"{name} exceeds {cap} bytes")
        data = f.read(cap + 1)
    if len(data) > cap:  # it grew while being read
        raise ApiError(413, "payload_too_large", f"{name} exceeds {cap} bytes")
    return data


def _why(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc)


def load_files(root: Path, tenant: str, lora_path: str, limits: Limits) -> dict[str, bytes]:
    """resolve + read_adapter: the files `lora_path` names for `tenant` (blocking I/O)."""
    directory = resolve(root, tenant, lora_path)
    return read_adapter(directory, tenant_folder(root, tenant), limits)
