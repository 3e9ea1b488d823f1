"""A DGFM swap's runner-side steps (Infinite-LLM's debt-cycle defragmentation), along one
edge of a cycle: debtor d holds blocks on creditor c. The debtor picks blocks its requests
hold there (`remote_picks`), the creditor copies their KV and takes them back
(RManager.take_home), and the debtor writes the copies into blocks of its own that its own
debtor just freed, replacing the creditor's ids in the requests' extents (`bring_home`).
A pick is (request id, block ids on the creditor). The scheduler plans the cycles
(scheduler/distkv/dgfm.py) and holds every runner on one between two steps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from punica_x.core import RemoteExtent
from punica_x.kv.blocks import KVCache
from punica_x.runtime import Request

Pick = tuple[str, tuple[int, ...]]


def remote_picks(requests: Iterable[Request], creditor: str, blocks: int) -> list[Pick]:
    """Debtor side: up to `blocks` blocks that `requests` hold on `creditor` (from the end
    of each request's extents there)."""
    out, left = [], blocks
    for r in list(requests):
        ids = [i for e in r.remote if e.owner == creditor for i in e.block_ids]
        take = ids[max(0, len(ids) - left) :]
        if take:
            out.append((r.request_id, tuple(take)))
            left -= len(take)
        if left == 0:
            break
    return out


def bring_home(
    cache: KVCache,
    requests: Mapping[str, Request],
    runner_id: str,
    creditor: str,
    picks: list[Pick],
    data: list,
) -> None:
    """Debtor side: each pick's KV (data[i]: [n, L, 2, N_kv, P, D]) into new blocks of this
    runner (its own debtor's take freed as many), which replace the creditor's ids in the
    request's extents."""
    for (rid, ids), kv in zip(picks, data):
        new = cache.allocator.allocate(len(ids))
        if new is None:  # cannot happen: its own debtor just freed as many here
            raise RuntimeError(f"DGFM: no room on {runner_id} for {len(ids)} blocks")
        cache.write_blocks(new, kv)
        _relocate(requests[rid], creditor, ids, runner_id, new)


def _relocate(r: Request, owner: str, moved: tuple[int, ...], home: str, new: list[int]) -> None:
    """In r's extents, blocks `moved` of `owner` are now blocks `new` of `home` (same
    logical positions); runs of one owner stay one extent."""
    where = dict(zip(moved, new))
    flat = [
        (home, where[i]) if e.owner == owner and i in where else (e.owner, i)
        for e in r.remote
        for i in e.block_ids
    ]
    extents: list[RemoteExtent] = []
    for o, i in flat:
        if extents and extents[-1].owner == o:
            extents[-1] = RemoteExtent(o, extents[-1].block_ids + (i,))
        else:
            extents.append(RemoteExtent(o, (i,)))
    r.remote = extents
