"""punica_x.side_thread: a call on a thread of its own, awaited."""

import asyncio
import threading

import pytest
import torch

from punica_x.side_thread import in_side_thread


def test_the_call_runs_on_a_thread_that_ends_and_its_result_or_error_comes_back():
    seen = []

    def work(a, b):
        seen.append(threading.current_thread())
        return torch.ones(a).sum().item() + b

    def fail():
        raise ValueError("bad adapter")

    async def main():
        assert await in_side_thread(work, 3, 1) == 4.0
        with pytest.raises(ValueError, match="bad adapter"):
            await in_side_thread(fail)

    asyncio.run(main())
    (thread,) = seen
    assert thread is not threading.main_thread() and thread.name == "punica-x-side"
    thread.join(5)
    assert not thread.is_alive()  # its OpenMP team, if any, went with it


def test_a_cancelled_wait_drops_the_result_without_an_error():
    release = threading.Event()

    async def main():
        task = asyncio.ensure_future(in_side_thread(release.wait, 5))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        await asyncio.sleep(0.05)  # the late result is dropped (no InvalidStateError)

    asyncio.run(main())


def test_torch_work_there_leaves_no_threads_behind():
    """A parallel torch op starts an OpenMP team for its thread; the team ends with the thread
    (on a long-lived executor thread it would stay, see the module's docstring)."""
    import os
    import time
    from concurrent.futures import ThreadPoolExecutor

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    def parallel_op() -> float:
        return torch.ones(1 << 22).exp().sum().item()

    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = threads()
        asyncio.run(in_side_thread(parallel_op))
        deadline = time.monotonic() + 5
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads() == before
        with ThreadPoolExecutor(1) as pool:  # a long-lived thread: it and its team stay
            pool.submit(parallel_op).result()
            assert threads() >= before + 2
    finally:
        torch.set_num_threads(was)


def test_on_side_thread_waits_and_raises_here():
    from punica_x.side_thread import on_side_thread

    names = []

    def work(a):
        names.append(threading.current_thread().name)
        return torch.ones(a).sum().item()

    assert on_side_thread(work, 4) == 4.0 and names == ["punica-x-side"]
    with pytest.raises(KeyError):
        on_side_thread({}.__getitem__, "missing")


def test_adapter_parsing_runs_on_a_side_thread(monkeypatch, tmp_path):
    """load_peft_adapter's torch work runs on a thread of its own, whoever calls it (the
    server's executor, a Ray runner's actor thread, LLM)."""
    from punica_x.lora import adapter

    seen = []
    monkeypatch.setattr(
        adapter, "_load_peft_adapter", lambda *a: seen.append(threading.current_thread().name)
    )
    adapter.load_peft_adapter(tmp_path, None, 16, torch.float32)
    assert seen == ["punica-x-side"]
