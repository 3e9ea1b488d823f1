"""The bound on what reordering a runner's batch can gain: SRPT with every output length
known in advance, run by the cluster simulator and by bench_mlfq on the real engine."""

from __future__ import annotations

from punica_x.batching.batcher_mlfq import MLFQBatcher


class OracleBatcher(MLFQBatcher):
    """Not a policy anyone can run: shortest remaining output first, with every request's
    output length known in advance (SRPT at token granularity, preemptive, same KV swapping).
    The fastserve experiment runs it as the bound on what any reordering of the same batch
    could gain over FCFS at a load."""

    def schedule(self):
        for r in (*self.running, *self.waiting):
            p = self.priority[r.request_id]
            p.level = r.sampling.max_tokens - len(r.output_token_ids)
            p.last_served_s = self.clock()  # never "starved"
        return super().schedule()
