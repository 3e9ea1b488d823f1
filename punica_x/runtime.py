"""The engine's own state types: a request as it runs (Request, RequestStatus) and one step's
batch (Batch, LoraBatchMeta). Not part of the runner's public face (punica_x/api.py): what
callers see are punica_x/core.py's types."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from punica_x.core import (
    FinishReason,
    RemoteExtent,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    new_request_id,
)
from punica_x.ops.sgmv_weights import SgmvWeights  # a leaf: it imports only torch

if TYPE_CHECKING:  # (annotations only: the pool's handle of a request's adapter)
    from punica_x.lora.pool import AdapterRef


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation. `all_token_ids` = prompt + generated; the first `num_computed_tokens`
    of them have KV in `block_ids`. A preempted request keeps its tokens and recomputes."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: AdapterRef | None = None
    request_id: str = field(default_factory=new_request_id)
    on_output: Callable[[RequestOutput], None] | None = None
    on_preempt: Callable[[str], None] | None = None  # told after a step that preempted it
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # KV swapped out to the host pool (MLFQ): it holds the first num_computed_tokens tokens
    host_block_ids: list[int] = field(default_factory=list)
    # DistKV: blocks borrowed from peer runners, after block_ids in logical order (a request
    # with remote blocks grows only there); borrow_after: when a refused borrow is retried;
    # borrow_since: when its peers first refused it, since it last got blocks (None: not waiting)
    remote: list[RemoteExtent] = field(default_factory=list)
    borrow_after: float = 0.0
    borrow_since: float | None = None
    # starving_since: when its peers first refused it since it last got blocks, kept over its
    # yields (KVBorrowing.give_up_s bounds the whole wait)
    starving_since: float | None = None
    # the most blocks its runner and the peers could hold for it when it got blocks: a
    # running request that needs no more than that, refused for want of peers (one died),
    # waits for room instead of ending with length (Batcher._grow)
    borrow_room: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    # prompt_logprobs[i]: of prompt token i (None for i = 0), filled as prefill chunks run
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of output_token_ids
    prompt_logprobs_sent: bool = False  # an output carried them (RequestOutput)
    prompt_sent: bool = False  # an output carried prompt_token_ids (RequestOutput)
    # outputs go out every stream_interval tokens (the first and the last at once); `held`:
    # the outputs since the last one that went, joined (engine/outputs.py emit)
    stream_interval: int = 1
    held: RequestOutput | None = None
    streamed: bool = False  # an output with tokens went out
    matcher: object | None = None  # llguidance matcher when sampling.json_schema is set
    # prefix caching (punica_x/kv/prefix.py): the parent name of its first block (what
    # computes its KV, who may share it), None when it is not cached; the names of its full
    # blocks computed so far
    cache_key: bytes | None = None
    block_names: list[bytes] = field(default_factory=list)
    # overlapped scheduling (engine/overlap.py): tokens sampled on the device and not yet known
    # on the host (0 or 1; counted in num_tokens, not in output_token_ids), the row of the
    # last submitted step's samples that holds it, and whether it is surely the request's
    # last token (max_tokens or the model's length reached): then it is not scheduled again
    num_inflight: int = 0
    inflight_row: int = 0
    final_in_flight: bool = False
    # sampling.plain, read per step by the sampler's fast path (step_sampling.sample_step)
    plain: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.plain = self.sampling.plain

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, those still in flight on the device included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_known_tokens(self) -> int:
        """Prompt + generated tokens known on the host (num_tokens less the in-flight)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class InputFills:
    """Input tokens still in flight when a batch was planned (overlapped steps): input_ids
    [where] take the previous step's samples [source]; where / source int64 [F] (host)."""

    where: torch.Tensor
    source: torch.Tensor

    def __len__(self) -> int:
        return int(self.where.numel())

    @classmethod
    def of(cls, pairs: list[tuple[int, int]]) -> InputFills | None:
        """From (row of input_ids, row of the previous step's samples) pairs; None if none."""
        if not pairs:
            return None
        t = torch.tensor(pairs, dtype=torch.int64).T
        return cls(t[0], t[1])


@dataclass(frozen=True)
class LoraBatchMeta:
    """SGMV metadata of one step, one entry per projection group ("qkv", "o", "gate_up",
    "down"), planned once and read by every layer. workspace: float32 [T, max rank sum].
    embed / head: LoRA on the embedding and the LM head, (first row, end row, A^T, B^T) of
    each run of rows whose adapter has it (empty: no row's adapter does, nothing to add).
    experts: LoRA on a mixture of experts, (first row, end row, the adapter's expert groups:
    lora/expert_layout.py) of each run of rows whose adapter has it (models/moe.py)."""

    groups: dict[str, SgmvWeights]
    workspace: torch.Tensor
    embed: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...] = ()
    head: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...] = ()
    experts: tuple[tuple[int, int, dict], ...] = ()


@dataclass(frozen=True)
class Batch:
    """One model invocation: rows of all scheduled requests, grouped by adapter.

    input_ids, positions: [T] int64; sample_rows: [B] int64 rows whose logits are sampled
    (the last row of each request that finishes its prompt or decodes this step).
    logit_rows: [B + P] int64, sample_rows then the P rows whose logits score prompt tokens
    (requests with prompt_logprobs), or None when P = 0; prompt_targets: per such request,
    the prompt positions those rows score, in row order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: object  # the attention backend's plan: write_kv(...) and attend(...)
    lora: LoraBatchMeta | None
    sample_rows: torch.Tensor
    logit_rows: torch.Tensor | None = None
    prompt_targets: tuple[tuple[Request, tuple[int, ...]], ...] = ()
    # overlapped steps (engine/overlap.py): the input tokens still in flight when the batch
    # was planned; the device fills them before the forward. None: every input is known.
    input_fills: InputFills | None = None
