"""Loading an adapter on its first request (frontend/tenancy/lora_on_request.py), without a
server: a load slower than the wait answers 504 and goes on to the end; names that are not a
folder of the tenant's source are not loaded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from frontend.config import Limits
from frontend.http.errors import ApiError
from frontend.tenancy import lora_on_request
from frontend.tenancy.lora_sources import LocalSource
from frontend.tenancy.uploads import CONFIG, WEIGHTS

CALLER = SimpleNamespace(tenant=SimpleNamespace(name="t"))


class SlowManager:
    """FrontendManager.load_adapter's part here: the source's read (which refuses what is
    not an adapter folder of the tenant's), then a slow store."""

    def __init__(self, source: LocalSource) -> None:
        self.source, self.loaded = source, []

    async def load_adapter(self, caller, name, lora_path, replace):
        assert (lora_path, replace) == (name, False)
        await asyncio.to_thread(self.source.read, caller.tenant.name, lora_path, Limits())
        await asyncio.sleep(0.3)
        self.loaded.append(name)
        return object()


def test_a_slow_load_answers_504_and_goes_on(tmp_path, monkeypatch):
    (tmp_path / "t" / "slow").mkdir(parents=True)
    for f in (CONFIG, WEIGHTS):
        (tmp_path / "t" / "slow" / f).write_bytes(b"{}")
    monkeypatch.setattr(lora_on_request, "LOAD_WAIT_S", 0.05)
    manager = SlowManager(LocalSource(tmp_path))

    async def main():
        with pytest.raises(ApiError) as refused:
            await lora_on_request.load_on_request(manager, CALLER, "slow")
        assert (refused.value.status, refused.value.code) == (504, "adapter_load_timeout")
        assert manager.loaded == []
        await asyncio.sleep(0.5)  # the load was not cancelled with the request's wait
        return manager.loaded

    assert asyncio.run(main()) == ["slow"]


@pytest.mark.parametrize("name", ["missing", "file", "../t", "", "a/b", ".hidden", 5, None])
def test_what_is_not_a_folder_of_the_tenant_is_not_loaded(tmp_path, name):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "file").write_text("x")
    (tmp_path / "t" / ".hidden").mkdir()
    manager = SlowManager(LocalSource(tmp_path))
    assert asyncio.run(lora_on_request.load_on_request(manager, CALLER, name)) is False
    assert manager.loaded == []
