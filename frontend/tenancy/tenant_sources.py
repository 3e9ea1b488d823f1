"""Where each tenant's adapters are loaded from by path: the server's root (serve
--lora-source-root DIR or s3://BUCKET/PREFIX gives tenant T the folder <root>/T/,
lora_sources.py and object_sources.py), or the tenant's own object-store root, which the
operator sets (PATCH /admin/tenants/{name} {"lora_source": "s3://BUCKET/PREFIX"}; "" goes
back to the server's root): its adapters are then the folders under that URI itself, and
none under the server's root. A platform whose tenants keep their fine-tunes in buckets of
their own serves them without copying them under one prefix.

Only the operator sets a tenant's source: the server reads it with the server's own
credentials (the AWS environment), so a tenant that could name any bucket could make the
server read what the tenant itself cannot (a confused deputy). Per-tenant credentials are
not served. The URI is checked as --lora-source-root is (parse_root: the schemes served, a
bucket name, no empty, "." or ".." segments, no query or fragment); it is 400
invalid_lora_source otherwise, and also when this server cannot read object stores
(s3fs not installed). Each tenant's lora_path is then checked against its own root exactly
as against the server's (a key outside it is 403 lora_path_forbidden), and stored versions
record the URI and ETags they were read at, so changing a tenant's source changes nothing
already loaded."""

from __future__ import annotations

import threading

from frontend.http.errors import bad_request
from frontend.tenancy.lora_sources import open_source
from frontend.tenancy.records import Tenant

MAX_SOURCE_CHARS = 1024


class TenantSources:
    """The server's root source (None: off) and the tenants' own ones, made on first use
    and sharing one object-store client."""

    def __init__(self, root, timeout_s: float) -> None:
        self.root_source = open_source(root, timeout_s)
        self.timeout_s = timeout_s
        self._own: dict[str, object] = {}  # URI -> its ObjectSource
        self._fs = getattr(self.root_source, "fs", None)  # the server's client, if it has one
        self._lock = threading.Lock()

    def for_tenant(self, tenant: Tenant):
        """The source `tenant` loads from: its own, else the server's root (None: off)."""
        if tenant.lora_source:
            return self._own_source(tenant.lora_source)
        return self.root_source

    def check(self, uri: object) -> str | None:
        """A tenant source as the operator gives it, checked: the URI, or None for "" (the
        server's root again); ApiError 400 invalid_lora_source saying what is wrong."""
        if not isinstance(uri, str) or len(uri) > MAX_SOURCE_CHARS:
            raise _invalid(f"an object-store URI of at most {MAX_SOURCE_CHARS} characters")
        if uri == "":
            return None
        from frontend.tenancy.object_sources import check_installed, parse_root

        try:
            check_installed()
            return str(parse_root(uri))
        except ValueError as exc:
            raise _invalid(str(exc).replace("--lora-source-root", "lora_source")) from None

    def _own_source(self, uri: str):
        from frontend.tenancy.object_sources import ObjectSource, parse_root, s3_filesystem

        with self._lock:
            source = self._own.get(uri)
            if source is None:
                if self._fs is None:
                    self._fs = s3_filesystem(self.timeout_s)
                source = ObjectSource(parse_root(uri), self.timeout_s, fs=self._fs, own=True)
                self._own[uri] = source
            return source


def _invalid(why: str):
    return bad_request("invalid_lora_source", f"lora_source: {why}", "lora_source")
