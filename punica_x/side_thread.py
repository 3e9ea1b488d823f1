"""Work with torch ops off the step loop's thread, on a thread that ends with the call.

A thread that runs a parallel torch op (or one of our kernels) gets an OpenMP team of its own,
and the team's threads live as long as that thread. A long-lived worker (asyncio.to_thread's
executor) thus leaves OpenMP threads behind, and once libgomp manages more threads than the
machine has cores it stops spinning between parallel regions on every team: the step loop's
~120 kernel calls a decode step then each wait for a futex wake-up. Measured on 2 cores
(SmolLM2-135M, Q4_1 blocks, one stream through the server): 121 tok/s, and 74 once 32 adapter
uploads had been parsed on the executor's threads. A thread of its own per call frees its team
when it ends: on_side_thread() where the work is done (adapter parsing, whoever calls it: the
server, a Ray runner, LLM), in_side_thread() for a coroutine that hands such work off."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
NAME = "punica-x-side"


def on_side_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread, waited for; its exception is raised here."""
    out: list = [None, None]  # result, error

    def run() -> None:
        try:
            out[0] = fn(*args)
        except BaseException as e:  # re-raised on the calling thread
            out[1] = e

    thread = threading.Thread(target=run, name=NAME, daemon=True)
    thread.start()
    thread.join()
    if out[1] is not None:
        raise out[1]
    return out[0]


async def in_side_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread, awaited; its exception is raised here. Cancelling the
    awaiting task does not stop fn (as with asyncio.to_thread); its result is dropped."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(error: BaseException | None, result) -> None:
        if done.done():  # the awaiting task was cancelled
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting task, as to_thread does
            loop.call_soon_threadsafe(settle, e, None)
        else:
            loop.call_soon_threadsafe(settle, None, result)

    threading.Thread(target=run, name=NAME, daemon=True).start()
    return await done
