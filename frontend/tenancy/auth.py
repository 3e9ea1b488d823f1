"""API keys and the admin token. Keys are random (256 bits), stored as SHA-256 hashes and
compared in constant time; the admin token lives in the data dir with mode 0600."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from starlette.requests import HTTPConnection

from frontend.http.errors import ApiError
from frontend.tenancy import durable
from frontend.tenancy.records import Tenant
from frontend.tenancy.store import Store, StoreError

KEY_PREFIX = "pxk-"
ADMIN_TOKEN_FILE = "admin_token"
ADMIN_TOKEN_ENV = "PUNICA_X_ADMIN_TOKEN"


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def ensure_admin_token(data_dir: Path) -> tuple[str, Path, bool]:
    """(token, its file, created now). The file is created with mode 0600, written whole
    (a temporary file, fsynced, then renamed), so a kill never leaves an empty token."""
    path = data_dir / ADMIN_TOKEN_FILE
    if path.exists():
        token = path.read_text().strip()
        if not token:
            raise StoreError(f"the admin token file {path} is empty; delete it to make a new one")
        return token, path, False
    token = "pxa-" + secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    durable.fsync_dir(path.parent)
    return token, path, True


def read_admin_token(data_dir: Path) -> str | None:
    if os.environ.get(ADMIN_TOKEN_ENV):
        return os.environ[ADMIN_TOKEN_ENV]
    path = data_dir / ADMIN_TOKEN_FILE
    return path.read_text().strip() if path.exists() else None


def bearer(conn: HTTPConnection, allow_query: bool = False) -> str | None:
    header = conn.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if allow_query:
        return conn.query_params.get("token") or None
    return None


class Authenticator:
    def __init__(self, store: Store, admin_token: str) -> None:
        self.store = store
        self.admin_token = admin_token

    def tenant(self, conn: HTTPConnection, allow_query: bool = False) -> tuple[Tenant, str]:
        """(tenant, key hash) of the caller's API key, else 401."""
        key = bearer(conn, allow_query)
        if not key:
            raise ApiError(
                401, "missing_api_key", "send your API key as 'Authorization: Bearer <key>'"
            )
        digest = hash_key(key)
        found = self.store.tenant_by_key_hash(digest)
        if found is None or not hmac.compare_digest(found[1], digest):
            raise ApiError(401, "invalid_api_key", "the API key is not valid")
        return found[0], digest

    def admin(self, conn: HTTPConnection) -> None:
        token = bearer(conn) or ""
        if not hmac.compare_digest(token.encode(), self.admin_token.encode()):
            raise ApiError(401, "invalid_admin_token", "this route needs the admin token")
