"""Adapters read from an object store (frontend/tenancy/object_sources.py) against an
S3-compatible server the test starts (moto's), through the real s3fs client: keys inside the
tenant's prefix read with their ETags; every hostile path, object and store fault a clear
4xx/5xx before anything is kept."""

from __future__ import annotations

import time

import pytest
from s3_store import BUCKET, FaultyProxy, aws_environment, moto_store, put_folder

from frontend.config import Limits
from frontend.http.errors import ApiError
from frontend.tenancy.object_sources import ObjectRoot, ObjectSource, parse_root
from frontend.tenancy.uploads import CONFIG, WEIGHTS

pytest.importorskip("s3fs")
LIMITS = Limits(max_upload_bytes=200_000)


@pytest.fixture(scope="module")
def store(adapter_dirs):
    """(endpoint, boto3 client) with acme's lora-a and other's lora-b under root/."""
    with moto_store() as (url, client):
        put_folder(client, "root/acme/lora-a", adapter_dirs["a"])
        put_folder(client, "root/acme/team/lora-b", adapter_dirs["b"])
        put_folder(client, "root/other/lora-b", adapter_dirs["b"])
        with aws_environment(url):
            yield url, client


def _source(timeout_s: float = 5.0) -> ObjectSource:
    return ObjectSource(parse_root(f"s3://{BUCKET}/root"), timeout_s)


def _refused(call) -> ApiError:
    with pytest.raises(ApiError) as err:
        call()
    return err.value


def test_a_key_inside_the_prefix_reads_with_its_etags(store, adapter_dirs):
    src = _source()
    for path in ("lora-a", "lora-a/", f"s3://{BUCKET}/root/acme/lora-a"):
        got = src.read("acme", path, LIMITS)
        assert got.files == {f: (adapter_dirs["a"] / f).read_bytes() for f in (CONFIG, WEIGHTS)}
        uri, etags = got.source.split("#etag=")
        assert uri == f"s3://{BUCKET}/root/acme/lora-a" and len(etags.split(",")) == 2
        assert all(len(e) == 32 for e in etags.split(","))  # moto's MD5 ETags
    assert src.read("acme", "team/lora-b", LIMITS).files[CONFIG]
    for missing in ("lora-b", "nothing"):  # how a request naming no adapter learns it
        err = _refused(lambda m=missing: src.read("acme", m, LIMITS))
        assert (err.status, err.code) == (404, "lora_path_not_found")


@pytest.mark.parametrize(
    "path, status, code",
    [
        ("../other/lora-b", 400, "invalid_lora_path"),
        ("lora-a/../../other/lora-b", 400, "invalid_lora_path"),
        ("./lora-a", 400, "invalid_lora_path"),
        ("a//lora-a", 400, "invalid_lora_path"),
        ("lora-a\x01", 400, "invalid_lora_path"),
        ("lora-a\x00", 400, "invalid_lora_path"),
        ("\ud800", 400, "invalid_lora_path"),
        ("", 400, "invalid_lora_path"),
        ("/root/acme/lora-a", 400, "invalid_lora_path"),
        ("x" * 1100, 400, "invalid_lora_path"),
        (f"s3://{BUCKET}/root/other/lora-b", 403, "lora_path_forbidden"),
        (f"s3://{BUCKET}/root/acme", 403, "lora_path_forbidden"),
        (f"s3://{BUCKET}/root/acmes/x", 403, "lora_path_forbidden"),
        (f"s3://{BUCKET}/root/acme/../other/lora-b", 400, "invalid_lora_path"),
        ("s3://elsewhere/root/acme/lora-a", 403, "lora_path_forbidden"),
        (f"s3://{BUCKET}/root/acme/lora-a?versionId=1", 400, "invalid_lora_path"),
        (f"gs://{BUCKET}/root/acme/lora-a", 400, "unsupported_source"),
        ("file:///etc", 400, "unsupported_source"),
        ("http://[bad/x", 400, "invalid_lora_path"),
        ("not-there", 404, "lora_path_not_found"),
    ],
)
def test_hostile_paths_are_refused(store, path, status, code):
    err = _refused(lambda: _source().read("acme", path, LIMITS))
    assert (err.status, err.code) == (status, code), err.message


def test_hostile_objects_are_refused(store, adapter_dirs):
    _, client = store
    config = (adapter_dirs["a"] / CONFIG).read_bytes()
    client.put_object(Bucket=BUCKET, Key=f"root/acme/no-weights/{CONFIG}", Body=config)
    client.put_object(Bucket=BUCKET, Key=f"root/acme/big/{CONFIG}", Body=config)
    client.put_object(Bucket=BUCKET, Key=f"root/acme/big/{WEIGHTS}", Body=b"\0" * 200_001)
    src = _source()
    err = _refused(lambda: src.read("acme", "no-weights", LIMITS))
    assert (err.status, err.code) == (400, "missing_file")
    err = _refused(lambda: src.read("acme", "big", LIMITS))
    assert (err.status, err.code) == (413, "payload_too_large")


def test_each_read_names_the_versions_it_read(store, adapter_dirs):
    """The ETags in the source are those of the bytes read (one GET gives both): an object
    replaced since is read whole at its new version, and named by its new ETag."""
    _, client = store
    put_folder(client, "root/acme/moving", adapter_dirs["a"])
    src = _source()

    def etags() -> list[str]:
        key = "root/acme/moving/"
        return [client.head_object(Bucket=BUCKET, Key=key + f)["ETag"].strip('"')
                for f in (CONFIG, WEIGHTS)]  # fmt: skip

    first = src.read("acme", "moving", LIMITS)
    assert first.source.split("#etag=")[1].split(",") == etags()
    new = (adapter_dirs["a"] / WEIGHTS).read_bytes()[::-1]  # as many bytes, another ETag
    client.put_object(Bucket=BUCKET, Key=f"root/acme/moving/{WEIGHTS}", Body=new)
    again = src.read("acme", "moving", LIMITS)
    assert again.files[WEIGHTS] == new and again.files[CONFIG] == first.files[CONFIG]
    assert again.source.split("#etag=")[1].split(",") == etags() != first.source.split(",")


def test_an_adapter_is_two_gets_and_an_empty_object_is_read_as_empty(store, adapter_dirs):
    """One ranged GET per file, no HEAD: two round trips per adapter. An empty object is
    empty bytes (S3 refuses a range of it: InvalidRange), which the file checks refuse."""
    url, client = store
    host, port = url.removeprefix("http://").split(":")
    proxy = FaultyProxy((host, int(port)))
    client.put_object(Bucket=BUCKET, Key=f"root/acme/empty/{CONFIG}", Body=b"")
    client.put_object(Bucket=BUCKET, Key=f"root/acme/empty/{WEIGHTS}", Body=b"")
    try:
        with aws_environment(proxy.url):
            src = _source()
            assert src.read("acme", "lora-a", LIMITS).files[CONFIG]
            assert proxy.requests == ["GET", "GET"]
            assert src.read("acme", "empty", LIMITS).files == {CONFIG: b"", WEIGHTS: b""}
    finally:
        proxy.close()


def test_a_store_that_hangs_or_fails_is_504_or_502(store, adapter_dirs):
    url, _ = store
    host, port = url.removeprefix("http://").split(":")
    proxy = FaultyProxy((host, int(port)))
    try:
        with aws_environment(proxy.url):
            src = _source(timeout_s=0.5)
            assert src.read("acme", "lora-a", LIMITS).files[CONFIG]  # through the proxy
            proxy.mode = "hang"
            t0 = time.monotonic()
            err = _refused(lambda: src.read("acme", "lora-a", LIMITS))
            assert (err.status, err.code) == (504, "source_timeout")
            assert time.monotonic() - t0 < 10  # two tries of 0.5 s, and backoff
            proxy.mode = "error"
            err = _refused(lambda: _source(timeout_s=2).read("acme", "lora-a", LIMITS))
            assert (err.status, err.code) == (502, "source_unavailable")
    finally:
        proxy.close()


@pytest.mark.parametrize(
    "value",
    [
        "s3://",
        "s3://UPPER/x",
        "s3://a/x",
        "s3://bucket/../x",
        "s3://bucket/a//b",
        "s3://bucket/x?y=1",
        "s3://bucket/x#f",
        "http://bucket/x",
        "gs://bucket/x",
    ],
)
def test_bad_roots_are_refused_at_start(value):
    with pytest.raises(ValueError, match="--lora-source-root"):
        parse_root(value)


def test_roots_parse():
    assert parse_root("s3://my-bucket") == ObjectRoot("s3", "my-bucket", "")
    assert parse_root("s3://my-bucket/a/b/") == ObjectRoot("s3", "my-bucket", "a/b")
    src = ObjectSource(parse_root("s3://my-bucket"), fs=object())
    assert src.key("t", "x") == "t/x" and src.describe("t") == "s3://my-bucket/t/"


def test_a_tenants_own_root_holds_its_keys_itself():
    own = ObjectSource(parse_root("s3://my-bucket/teams/own"), fs=object(), own=True)
    assert (
        own.key("anyone", "x") == "teams/own/x" and own.describe("t") == "s3://my-bucket/teams/own/"
    )
    assert own.key("t", "s3://my-bucket/teams/own/a/b/") == "teams/own/a/b"
    for path in ("s3://my-bucket/teams/other/x", "s3://other-bucket/teams/own/x"):
        assert _refused(lambda p=path: own.key("t", p)).code == "lora_path_forbidden"
    assert _refused(lambda: own.key("t", "../other/x")).code == "invalid_lora_path"
    whole = ObjectSource(parse_root("s3://my-bucket"), fs=object(), own=True)  # a bucket each
    assert whole.key("t", "a/b") == "a/b" and whole.key("t", "s3://my-bucket/z") == "z"
    assert _refused(lambda: whole.key("t", "s3://other-bucket/z")).code == "lora_path_forbidden"
    assert _refused(lambda: whole.key("t", "./z")).code == "invalid_lora_path"


def test_tenant_sources_check_what_the_operator_gives():
    from frontend.tenancy.records import Tenant
    from frontend.tenancy.tenant_sources import TenantSources

    sources = TenantSources(None, 5.0)
    assert sources.check("s3://my-bucket/teams/own/") == "s3://my-bucket/teams/own"
    assert sources.check("") is None
    for bad in (None, 7, "gs://b/x", "s3://B/x", "s3://my-bucket/a/../b", "s3://my-bucket/x?v=1",
                "s3://my-bucket/x\x01", "s3://my-bucket/" + "x" * 1100):  # fmt: skip
        err = _refused(lambda b=bad: sources.check(b))
        assert (err.status, err.code) == (400, "invalid_lora_source"), bad
    t = Tenant(1, "t", 0.0, False, None, None)
    assert sources.for_tenant(t) is None  # no root, no source of its own: loading is off
    own = Tenant(1, "t", 0.0, False, None, None, lora_source="s3://my-bucket/teams/own")
    got = sources.for_tenant(own)
    assert got.own and got.key("t", "x") == "teams/own/x" and sources.for_tenant(own) is got
