"""Loading an adapter on its first request (frontend/tenancy/lora_on_request.py), without a
server: a load slower than the wait answers 504 and goes on to the end; names that are not a
folder of the tenant's source are not loaded."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from frontend.http.errors import ApiError
from frontend.tenancy import lora_on_request
from frontend.tenancy.lora_sources import LocalSource

CALLER = SimpleNamespace(tenant=SimpleNamespace(name="t"))


class SlowManager:
    limits = None

    def __init__(self) -> None:
        self.loaded: list[str] = []

    async def load_adapter(self, caller, name, lora_path, replace):
        assert (lora_path, replace) == (name, False)
        await asyncio.sleep(0.3)
        self.loaded.append(name)
        return object()


def test_a_slow_load_answers_504_and_goes_on(tmp_path, monkeypatch):
    (tmp_path / "t" / "slow").mkdir(parents=True)
    monkeypatch.setattr(lora_on_request, "LOAD_WAIT_S", 0.05)
    manager = SlowManager()

    async def main():
        with pytest.raises(ApiError) as refused:
            await lora_on_request.load_on_request(manager, CALLER, LocalSource(tmp_path), "slow")
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
    manager = SlowManager()
    assert (
        asyncio.run(lora_on_request.load_on_request(manager, CALLER, LocalSource(tmp_path), name))
        is False
    )
    assert manager.loaded == []
