"""The garbage collector and the step loop.

CPython's cycle collector runs whenever the net count of new container objects passes its
first threshold, and from time to time (when a quarter more objects have survived since the
last one) it walks every object the process holds that is not frozen. A step allocates
objects (outputs, the plan's lists, per-request bookkeeping), so a process that holds a large
heap (a server's tenants, tokenizers and adapters; a notebook that ran HF transformers and
PEFT before punica-x) pays for walking it inside its steps: 3.7x slower Distinct steps were
measured on a Xeon with HF + 32 PEFT adapters resident (issue 29). vLLM freezes its heap
after start-up for the same reason.

`freeze_heap` moves everything alive now into the permanent generation, which collections
skip: called when an engine is built (the model, its tokenizer and kernels loaded: every
`Engine`, so `LLM`, thread runners and Ray runner processes alike), after `LLM.load_adapter`
and once the server is ready (its stored adapters restored). Objects made later are
collected as always. What it gives up: an object frozen now that later becomes part of
unreachable cycles is never reclaimed (objects freed by reference counting, the engine and
its KV cache among them, are freed as before); `thaw` gives them back to the collector where
a whole engine is let go (a dead runner).

`PUNICA_X_GC_FREEZE=0` turns freezing off (to measure what it saves)."""

from __future__ import annotations

import gc
import logging
import os
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get("PUNICA_X_GC_FREEZE", "1") != "0"


def freeze_heap(reason: str) -> int:
    """Collect, then freeze every object alive now (see the module docstring); returns the
    number of frozen objects (0 when freezing is off)."""
    if not enabled():
        return 0
    with _lock:
        gc.collect()
        gc.freeze()
        frozen = gc.get_freeze_count()
    log.debug("froze the heap (%s): %d objects", reason, frozen)
    return frozen


def thaw(reason: str) -> int:
    """Give the frozen objects back to the collector, collect the unreachable ones among
    them, and freeze the rest again; returns the number of objects collected."""
    with _lock:
        gc.unfreeze()
        collected = gc.collect()
        if enabled():
            gc.freeze()
    log.debug("thawed the heap (%s): %d objects collected", reason, collected)
    return collected
