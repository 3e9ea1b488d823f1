"""A simulated device: the host path measured on a CPU (benchmarks only).

On a GPU a decode step's forward runs on the device while the host is free to go on: if the
host's own work per step (scheduling, LoRA plans, sampling orchestration, outputs, the server)
exceeds the device's time, the device waits, and a step costs host + device when the two run
one after the other. SimulatedForward stands in for the model's forward to show exactly this on
a machine without a GPU: each call holds `step_ms` of wall time *without the interpreter lock*
(time.sleep releases it, as a thread waiting on a CUDA stream does), and everything around it,
the engine, the batcher, the planner, the sampler, the detokenizer, the server, is the real code.

Its logits are a pure function of each sampled row's input token and position (a one-hot at
next_token(id, position)), so greedy generation is deterministic, varied, independent of the
batch, and the same with any scheduling of the host's work. The KV cache is neither written nor
read: the simulated device models time, not attention.

Like a GPU's stream, it keeps a timeline: a step launched (launch) occupies the device for
step_ms after the previous one ends, and its results are ready then; the host is free
meanwhile (overlapped steps read them with wait_until), or waits at once (a synchronous call).
Only the host's work is real CPU time; the device's is modelled, so no thread of the device
competes with the host for the interpreter lock, as a GPU's kernels do not.

ModelConfig.simulated_step_ms (serve --simulated-step-ms) turns it on; the engine then calls
it instead of the model (no CUDA graphs). It records how long its callers waited on it
(`waited_s`, `calls`): a step's host work is its wall time less that wait."""

from __future__ import annotations

import threading
import time

import torch

# Token ids below this are left out of the simulated outputs: the tokenizers' special tokens
# (unk, bos, eos in the small test tokenizer; SmolLM2's <|endoftext|>, <|im_start|>, ...).
FIRST_TOKEN = 17


def next_token(ids: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The simulated model's greedy choice after token `ids` at `positions` (int64 [B] each):
    a hash of the two into [FIRST_TOKEN, vocab), the same on every call."""
    span = vocab - FIRST_TOKEN
    mixed = ids * 7919 + positions * 104729 + 13
    return FIRST_TOKEN + torch.remainder(mixed, span)


class SimulatedForward:
    """Called as the model is, forward(batch, kv, backend) -> logits float32 [B (+ P), vocab]
    (Batch.sample_rows, or Batch.logit_rows when prompt rows are scored), after `step_ms` of
    wall time from the call without the interpreter lock. vocab: the model's; token_limit: the
    ids the simulated model picks stay below it (the tokenizer's size, so every token decodes
    to text as a real model's would), at most vocab."""

    def __init__(self, step_ms: float, vocab: int, token_limit: int | None = None) -> None:
        if not step_ms > 0:
            raise ValueError(f"step_ms must be > 0, got {step_ms!r}")
        self.step_s = step_ms / 1000.0
        self.vocab = vocab
        self.token_limit = min(vocab, token_limit or vocab)
        if self.token_limit <= FIRST_TOKEN:
            raise ValueError(f"a vocabulary of {self.token_limit} leaves no simulated tokens")
        self._lock = threading.Lock()
        self.ready_at = 0.0  # perf_counter time at which the device finishes its last step
        self.waited_s = 0.0  # total wall time callers spent waiting on the device
        self.calls = 0

    def __call__(self, batch, kv=None, backend=None) -> torch.Tensor:
        """A synchronous step: launch, then wait until the device is done with it."""
        start = time.perf_counter()
        logits = self.launch(batch)
        self.wait_until(self.ready_at, since=start)
        return logits

    def launch(self, batch, kv=None, backend=None) -> torch.Tensor:
        """An asynchronous step, as a CUDA launch: the logits at once, the device busy until
        ready_at (step_ms after it is free: steps queue one after another, as on a stream).
        Whoever reads the step's results waits until then (wait_until)."""
        launched = time.perf_counter()  # a launch returns at once: the device starts now
        rows = batch.sample_rows if batch.logit_rows is None else batch.logit_rows
        ids, positions = batch.input_ids[rows], batch.positions[rows]
        picked = next_token(ids, positions, self.token_limit)
        logits = torch.zeros(len(picked), self.vocab, dtype=torch.float32)
        logits[torch.arange(len(picked)), picked] = 1.0
        with self._lock:
            self.ready_at = max(launched, self.ready_at) + self.step_s
            self.calls += 1
        return logits

    def wait_until(self, ready_at: float, since: float | None = None) -> None:
        """Sleep (the interpreter lock free) until the device reaches ready_at; the wait, from
        `since` when given, counts in waited_s."""
        start = time.perf_counter()
        if ready_at > start:
            time.sleep(ready_at - start)
        with self._lock:
            self.waited_s += time.perf_counter() - (start if since is None else since)

    def reset(self) -> None:
        """Zero the wait counters (a benchmark's warm-up done)."""
        with self._lock:
            self.waited_s, self.calls = 0.0, 0
