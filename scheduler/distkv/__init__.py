"""DistKV (Infinite-LLM / DistAttention): runners lend each other KV blocks for a request no
single runner can hold, behind one interface for the scheduler (group.py's KVGroup).

- group.py: KVGroup, ThreadKVGroup and make_kv_group; the scheduler sees only these;
- network.py: thread runners' KVNetwork (borrowers, rManagers, the in-process ledger, DGFM
  swaps carried out between paused engines);
- ray_group.py: the same between Ray runner processes (the ledger as an actor);
- channel.py: the data plane between runner processes (Unix / TCP sockets);
- ledger.py: the Global Debt Ledger and creditor suggestions (pure bookkeeping);
- dgfm.py: debt-cycle swap planning (pure policy).
"""
