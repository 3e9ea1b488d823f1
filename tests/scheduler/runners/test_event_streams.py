"""The scheduler's side of a runner in another process (scheduler/runners/event_streams.py):
every event reaches its request's stream once. A request taken off a runner and placed back
on it at once keeps its id (a fair-share yield while one runner serves): the events the take
handed over, which the pump may still bring, are not its new stream's. The fault campaign
saw it as a token streamed twice (' 11.' for ' 1.')."""

from __future__ import annotations

import asyncio

from punica_x.api import EngineRequest, RequestOutput, SamplingParams
from scheduler.runners.event_streams import EventStreams
from scheduler.runners.ray_events import OutputEvent


def output(rid: str, token: int) -> RequestOutput:
    return RequestOutput(rid, [], [], "", [token], str(token), False)


class Core(EventStreams):
    """A runner whose calls answer from `replies` and whose pump never hears anything."""

    def __init__(self) -> None:
        self._init_streams()
        self.replies: dict[str, object] = {}

    async def _remote(self, method: str, *args):
        if method == "poll":
            await asyncio.Event().wait()
        return self.replies.get(method)


async def queued(stream) -> list[int]:
    got = []
    while not stream._outputs.empty():
        got += stream._outputs.get_nowait().new_token_ids
    return got


def test_a_request_placed_back_where_it_was_taken_gets_only_its_new_events():
    async def main():
        core = Core()
        request = EngineRequest([1, 2, 3], SamplingParams(max_tokens=8), None, "r")
        first = await core.open(request)
        core._dispatch([OutputEvent(1, "r", output("r", 10))])  # the pump delivers seq 1
        core.replies["take"] = (None, [OutputEvent(1, "r", output("r", 10)),
                                       OutputEvent(2, "r", output("r", 11))])  # fmt: skip
        await core.take("r")
        assert await queued(first) == [10, 11]
        again = await core.open(request)  # placed back on the same runner, same id
        # the pump's next reply: seq 2 again (not acknowledged yet), then the new stream's own
        core._dispatch([OutputEvent(2, "r", output("r", 11)), OutputEvent(3, "r", output("r", 12))])
        assert await queued(again) == [12]
        core._pump.cancel()

    asyncio.run(main())
