"""Adapter uploads: a capped multipart body, and archives unpacked defensively.

Accepted: fields `name` and either files `adapter_config.json` + `adapter_model.safetensors`,
or one file `archive` (.tar.gz or .zip, recognised by content) holding those two (optionally
under one top-level folder; a PEFT README.md is ignored). Refused before anything is kept:
bodies over the cap (413, decided from Content-Length when present, else while streaming),
archive members that are links, absolute or with `..`, more entries than the cap, more
unpacked bytes than the cap, unexpected names and pickle files.
"""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile
from pathlib import PurePosixPath

from starlette.datastructures import UploadFile
from starlette.requests import Request

from frontend.config import Limits
from frontend.http.errors import ApiError, bad_request

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
IGNORED = {"README.md"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
CHUNK = 1 << 20


class _BodyTooLarge(Exception):
    pass


def too_large(limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes")


async def read_upload(request: Request, limits: Limits) -> tuple[str, dict[str, bytes]]:
    """(adapter name, {file name: bytes}) of an upload request."""
    cap = limits.max_upload_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise too_large(cap)  # refused without reading the body
    received = 0

    async def receive():
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > cap:
                raise _BodyTooLarge
        return message

    capped = Request(request.scope, receive)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request(
            "invalid_upload", "send multipart/form-data with a name and the adapter files"
        )
    try:
        form = await capped.form(max_files=4, max_fields=4, max_part_size=4096)
    except _BodyTooLarge:
        raise too_large(cap) from None
    except Exception as exc:  # malformed multipart, too many parts, oversize text field
        raise bad_request("invalid_upload", f"could not parse the upload: {exc}") from None
    name = form.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("missing_name", "the upload needs a `name` field", "name")
    uploads = {key: value for key, value in form.multi_items() if isinstance(value, UploadFile)}
    unknown = sorted(set(uploads) - {CONFIG, WEIGHTS, "archive"})
    if unknown:
        raise bad_request("invalid_upload", f"unexpected file fields {unknown}")
    if "archive" in uploads:
        if len(uploads) != 1:
            raise bad_request("invalid_upload", "send either `archive` or the two adapter files")
        return name, _check_config(unpack_archive(await uploads["archive"].read(), limits), limits)
    if set(uploads) != {CONFIG, WEIGHTS}:
        raise bad_request(
            "missing_file", f"send the files {CONFIG} and {WEIGHTS} (or one `archive`)"
        )
    if uploads[CONFIG].size is not None and uploads[CONFIG].size > limits.max_config_bytes:
        raise _config_too_large(limits)
    files = {CONFIG: await uploads[CONFIG].read(), WEIGHTS: await uploads[WEIGHTS].read()}
    return name, _check_config(files, limits)


def _config_too_large(limits: Limits) -> ApiError:
    return ApiError(
        413,
        "config_too_large",
        f"{CONFIG} exceeds {limits.max_config_bytes} bytes (a PEFT config is a few hundred)",
    )


def _check_config(files: dict[str, bytes], limits: Limits) -> dict[str, bytes]:
    if len(files[CONFIG]) > limits.max_config_bytes:
        raise _config_too_large(limits)
    return files


def unpack_archive(data: bytes, limits: Limits) -> dict[str, bytes]:
    if data[:4] == b"PK\x03\x04":
        files = _unzip(data, limits)
    elif data[:2] == b"\x1f\x8b":
        files = _untar(data, limits)
    else:
        raise bad_request("invalid_archive", "the archive must be a .tar.gz or .zip file")
    missing = sorted({CONFIG, WEIGHTS} - set(files))
    if missing:
        raise bad_request("missing_file", f"the archive lacks {missing}")
    return files


def _member_name(raw: str) -> str | None:
    """The file name a member stands for, or None for a folder entry; refuses unsafe paths."""
    path = PurePosixPath(raw.replace("\\", "/"))
    if path.is_absolute() or raw.startswith(("/", "\\")) or ".." in path.parts or ":" in raw:
        raise bad_request("unsafe_archive", f"archive member {raw!r} has an unsafe path")
    parts = [p for p in path.parts if p not in ("", ".")]
    if len(parts) > 2:
        raise bad_request("unsafe_archive", f"archive member {raw!r} is nested too deep")
    if not parts:
        return None
    base = parts[-1]
    if base.lower().endswith(PICKLE_SUFFIXES):
        raise ApiError(
            400, "pickle_not_allowed", f"refusing pickle file {base!r} (safetensors only)"
        )
    return base


def _accept(
    files: dict[str, bytes], name: str | None, read, limits: Limits, total: list[int]
) -> None:
    if name is None:
        return
    if name not in (CONFIG, WEIGHTS) and name not in IGNORED:
        raise bad_request("unexpected_file", f"unexpected file {name!r} in the archive")
    if name in files:
        raise bad_request("invalid_archive", f"the archive holds {name!r} twice")
    out = io.BytesIO()
    while chunk := read(CHUNK):
        total[0] += len(chunk)
        if total[0] > limits.max_unpacked_bytes:
            raise ApiError(
                413,
                "archive_too_large",
                f"the archive unpacks to more than {limits.max_unpacked_bytes} bytes",
            )
        out.write(chunk)
    if name not in IGNORED:
        files[name] = out.getvalue()


def _untar(data: bytes, limits: Limits) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    total = [0]
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for count, member in enumerate(tar, start=1):
                if count > limits.max_archive_entries:
                    raise bad_request(
                        "too_many_entries",
                        f"the archive has more than {limits.max_archive_entries} entries",
                    )
                name = _member_name(member.name)
                if member.issym() or member.islnk():
                    raise bad_request("unsafe_archive", f"archive member {member.name!r} is a link")
                if member.isdir():
                    continue
                if not member.isfile():
                    raise bad_request(
                        "unsafe_archive", f"archive member {member.name!r} is not a file"
                    )
                _accept(files, name, tar.extractfile(member).read, limits, total)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise bad_request("invalid_archive", f"could not read the tar.gz archive: {exc}") from None
    return files


def _unzip(data: bytes, limits: Limits) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    total = [0]
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            infos = zf.infolist()
            if len(infos) > limits.max_archive_entries:
                raise bad_request(
                    "too_many_entries",
                    f"the archive has more than {limits.max_archive_entries} entries",
                )
            for info in infos:
                name = _member_name(info.filename)
                if stat.S_ISLNK(info.external_attr >> 16):
                    raise bad_request(
                        "unsafe_archive", f"archive member {info.filename!r} is a link"
                    )
                if info.is_dir():
                    continue
                with zf.open(info) as f:
                    _accept(files, name, f.read, limits, total)
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        EOFError,
        OSError,
        NotImplementedError,
    ) as exc:
        raise bad_request("invalid_archive", f"could not read the zip archive: {exc}") from None
    return files
