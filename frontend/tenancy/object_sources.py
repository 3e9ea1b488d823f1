"""Adapters in an object store: serve --lora-source-root s3://BUCKET/PREFIX gives tenant T the
objects under s3://BUCKET/PREFIX/T/, as a local root gives it DIR/T/ (lora_sources.py). S3
and the stores that speak its API (MinIO, R2, Ceph, ...), read through fsspec's s3fs with the
standard AWS environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_DEFAULT_REGION, profiles): the `s3` extra, pip install 'punica-x[s3]'.

A lora_path is a key relative to the tenant's prefix ("sql-lora", "team/sql-lora") or an
s3:// URI inside it; it names a "folder" holding adapter_config.json and
adapter_model.safetensors, which are then checked and stored as an upload's are. Refused
before any object is read, each with a 4xx that says why: another scheme (400
unsupported_source), another bucket or a key outside the tenant's prefix (403
lora_path_forbidden), empty, "." or ".." segments (a store keeps them literally, a local
mirror of it would not), control characters, a query or fragment, keys over S3's 1,024 bytes
(400 invalid_lora_path).

Each object is read with one ranged GET of its first cap + 1 bytes (two requests per adapter:
a HEAD before each GET doubled the round trips of a cold start and the store's work): the
object's size, from the response's Content-Range, is checked before its body is read, so
one over the upload limits is 413 and its body is never read. One response gives the bytes
and their ETag, so they are one version of the object; a body shorter than the size the
store announced with it is 409 source_changed (a connection cut mid-body is the client's
error: 502 source_unavailable), and nothing is kept. The stored version names the object
versions it was read at: its source is the URI and the two ETags,
"s3://BUCKET/KEY#etag=CONFIG,WEIGHTS" (listed in /v1/adapters and as `root` in /v1/models).

The store's faults are the request's, never the server's: no such object is 404 (the
folder) or 400 missing_file (its weights), a denied read 403 source_forbidden, a store that
does not answer within --lora-source-timeout-s (connect and each read; two tries) 504
source_timeout, one that answers an error 502 source_unavailable. The calls block: run them
off the event loop (the routes read on a worker thread; fsspec runs its own I/O loop)."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from frontend.config import Limits
from frontend.http.errors import ApiError, bad_request
from frontend.tenancy.source_files import SourceFiles, check_text
from frontend.tenancy.uploads import CONFIG, WEIGHTS

log = logging.getLogger(__name__)
SCHEMES = ("s3",)
MAX_KEY_BYTES = 1024  # S3's limit on a key
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
TRIES = 2  # each call to the store: one retry (s3fs's own loop, no botocore retries under it)


@dataclass(frozen=True)
class ObjectRoot:
    """The operator's root: scheme ("s3"), bucket, and a key prefix without slashes at its
    ends ("" for the bucket's top)."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")


def parse_root(value: str) -> ObjectRoot:
    """--lora-source-root as an object-store URI; ValueError saying what is wrong."""
    parts = urlsplit(value)
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"--lora-source-root {value!r}: the object stores served are {', '.join(SCHEMES)}:// "
            "(S3 and S3-compatible ones through AWS_ENDPOINT_URL), or give a local directory"
        )
    if not _BUCKET.fullmatch(parts.netloc) or parts.query or parts.fragment:
        raise ValueError(f"--lora-source-root {value!r}: want s3://BUCKET[/PREFIX]")
    prefix = parts.path.strip("/")
    if prefix and _bad_segments(prefix):
        raise ValueError(f"--lora-source-root {value!r}: {_bad_segments(prefix)}")
    return ObjectRoot(parts.scheme, parts.netloc, prefix)


def _bad_segments(key: str) -> str | None:
    """Why `key` (slash-separated) is refused, None when it is not."""
    if _CONTROL.search(key):
        return "control characters are not allowed"
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        return "empty, '.' and '..' segments are not allowed"
    return None


class ObjectSource:
    """Tenants' adapters under an ObjectRoot (the module's docstring). fs: an fsspec
    filesystem of the root's scheme (default: s3fs's, built from the AWS environment, with
    timeout_s for connecting and for each read). own: the root is one tenant's own source
    (tenant_sources.py): its keys are under the root itself, not under <root>/<tenant>/."""

    def __init__(self, root: ObjectRoot, timeout_s: float = 15.0, fs=None, own=False) -> None:
        self.root, self.timeout_s, self.own = root, timeout_s, own
        self.fs = fs if fs is not None else s3_filesystem(timeout_s)

    def describe(self, tenant: str) -> str:
        return f"{self.root}/" if self.own else f"{self.root}/{tenant}/"

    def tenant_prefix(self, tenant: str) -> str:
        """The key prefix of the tenant's adapters ("" for a tenant's own whole bucket)."""
        if self.own:
            return self.root.prefix
        return f"{self.root.prefix}/{tenant}" if self.root.prefix else tenant

    def key(self, tenant: str, lora_path: str) -> str:
        """The key of the adapter folder `lora_path` names for `tenant`; ApiError refusing it."""
        prefix = self.tenant_prefix(tenant)
        if "://" in lora_path:
            try:
                parts = urlsplit(lora_path)
            except ValueError as exc:
                raise bad_request("invalid_lora_path", f"lora_path: {exc}", "lora_path") from None
            if parts.scheme != self.root.scheme:
                raise bad_request(
                    "unsupported_source",
                    f"lora_path scheme {parts.scheme!r} is not served here: give a key under "
                    f"{self.describe(tenant)} or an {self.root.scheme}:// URI inside it",
                    "lora_path",
                )
            if parts.query or parts.fragment:
                raise bad_request(
                    "invalid_lora_path", "lora_path takes no query or fragment", "lora_path"
                )
            if parts.netloc != self.root.bucket:
                raise self._outside(tenant)
            key = parts.path.lstrip("/")
        elif lora_path.startswith("/"):
            raise bad_request(
                "invalid_lora_path",
                f"lora_path is a key relative to {self.describe(tenant)} or an "
                f"{self.root.scheme}:// URI, not an absolute path",
                "lora_path",
            )
        else:
            key = f"{prefix}/{lora_path}" if prefix else lora_path
        key = key.removesuffix("/")
        why = _bad_segments(key)
        if why is not None:
            raise bad_request("invalid_lora_path", f"lora_path: {why}", "lora_path")
        if prefix and not key.startswith(prefix + "/"):
            raise self._outside(tenant)
        if len(f"{key}/{WEIGHTS}".encode()) > MAX_KEY_BYTES:
            raise bad_request(
                "invalid_lora_path", f"lora_path: keys are at most {MAX_KEY_BYTES} bytes"
            )
        return key

    def read(self, tenant: str, lora_path: str, limits: Limits) -> SourceFiles:
        """The two PEFT files of `lora_path` and the source they were read at."""
        check_text(lora_path)
        key = self.key(tenant, lora_path)
        caps = {CONFIG: limits.max_config_bytes, WEIGHTS: limits.max_upload_bytes}
        files, etags = {}, []
        for name, cap in caps.items():
            files[name], etag = self._read_object(key, name, cap, lora_path)
            etags.append(etag)
        uri = f"{self.root.scheme}://{self.root.bucket}/{key}"
        return SourceFiles(files, f"{uri}#etag={','.join(etags)}")

    # -- one object ---------------------------------------------------------------------
    def _read_object(self, key: str, name: str, cap: int, lora_path: str) -> tuple[bytes, str]:
        path = f"{self.root.bucket}/{key}/{name}"
        try:
            data, size, etag = self._call(self._get, path, cap)
        except FileNotFoundError:
            if name == CONFIG:
                raise ApiError(
                    404, "lora_path_not_found", f"no adapter at {lora_path!r}", "lora_path"
                ) from None
            raise bad_request("missing_file", f"the adapter folder has no {name}") from None
        if size > cap:
            raise ApiError(413, "payload_too_large", f"{name} exceeds {cap} bytes")
        if len(data) != size:
            raise _changed(name)
        return data, etag

    def _get(self, path: str, cap: int) -> tuple[bytes, int, str]:
        """(the object's bytes, its size, its ETag) from one GET of its first cap + 1 bytes;
        the bytes are b"" when the size is over cap (the body is not read)."""
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)
        return sync(self.fs.loop, self._get_async, bucket, key, cap)

    async def _get_async(self, bucket: str, key: str, cap: int) -> tuple[bytes, int, str]:
        try:
            resp = await self.fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{cap}"
            )
        except OSError as exc:
            if _error_code(exc) == "InvalidRange":  # S3's answer to a range of an empty object
                return b"", 0, ""
            raise
        try:
            size = _object_size(resp)
            return (b"" if size > cap else await resp["Body"].read()), size, _etag(resp)
        finally:
            resp["Body"].close()

    def _call(self, fn, *args, **kwargs):
        """fn(...) with the store's faults as ApiErrors (FileNotFoundError passes: what is
        missing is the caller's to say)."""
        try:
            return fn(*args, **kwargs)
        except (ApiError, FileNotFoundError):
            raise
        except PermissionError as exc:
            raise ApiError(
                403, "source_forbidden", f"the object store denied the read: {exc}", "lora_path"
            ) from None
        except Exception as exc:  # noqa: BLE001 - whatever the client raises is the store's
            if _timed_out(exc):
                raise ApiError(
                    504,
                    "source_timeout",
                    f"the object store did not answer within {self.timeout_s:g} s",
                    "lora_path",
                    retry_after=5,
                ) from None
            log.warning("object store error reading an adapter: %r", exc)
            raise ApiError(
                502,
                "source_unavailable",
                f"the object store answered an error: {type(exc).__name__}: {exc}"[:500],
                "lora_path",
                retry_after=5,
            ) from None

    def _outside(self, tenant: str) -> ApiError:
        return ApiError(
            403,
            "lora_path_forbidden",
            f"lora_path must be inside your source prefix ({self.describe(tenant)})",
            "lora_path",
        )


def s3_filesystem(timeout_s: float):
    """s3fs's filesystem from the AWS environment: bounded connects and reads, no listings
    cache (a folder added to the store is seen at once)."""
    import s3fs

    config = {
        "connect_timeout": timeout_s,
        "read_timeout": timeout_s,
        "retries": {"max_attempts": 1},
    }
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, config_kwargs=config)
    fs.retries = TRIES
    return fs


def _error_code(exc: BaseException) -> str | None:
    """The store's error code under `exc` (s3fs raises an OSError whose cause is botocore's
    ClientError), None when it carries none."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
    return None


def _object_size(resp: dict) -> int:
    """The whole object's bytes from a ranged GET's response: Content-Range's total
    ("bytes 0-99/1234"), or its Content-Length where the store sent the whole object."""
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else int(resp.get("ContentLength") or 0)


def _etag(resp: dict) -> str:
    return str(resp.get("ETag") or "").strip('"')


def _changed(name: str) -> ApiError:
    return ApiError(
        409,
        "source_changed",
        f"{name} changed in the object store while it was read; load it again",
        "lora_path",
    )


def _timed_out(exc: BaseException) -> bool:
    """Whether the client gave up waiting (botocore's, aiohttp's, asyncio's or the socket's
    timeout, however deep in the chain)."""
    return any(
        isinstance(e, (TimeoutError, asyncio.TimeoutError, socket.timeout))
        or "Timeout" in type(e).__name__  # botocore ConnectTimeoutError, ReadTimeoutError
        for e in _chain(exc)
    )


def _chain(exc: BaseException | None, depth: int = 8):
    """exc and what caused it, up to `depth` deep (the clients wrap their errors)."""
    while exc is not None and depth > 0:
        yield exc
        exc, depth = exc.__cause__ or exc.__context__, depth - 1


def check_installed() -> None:
    """ValueError when s3fs is not installed (said at start, not on the first request)."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        raise ValueError(
            "--lora-source-root s3://... reads through s3fs: pip install 'punica-x[s3]'"
        ) from None
