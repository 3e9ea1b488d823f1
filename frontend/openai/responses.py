"""OpenAI response bodies of one GenerationRequest: the whole answer, or the stream's chunks.

Choice i of the answer is the GenerationRequest's choice i. A completion's text starts with
the prompt under `echo`; with `score_only` (echo, max_tokens 0) it is the prompt alone and
the one token sampled to score it is dropped."""

from __future__ import annotations

import time
import uuid

from frontend.openai.generation import GenerationRequest
from frontend.openai.logprobs_format import TokenText, chat_logprobs, completion_logprobs
from punica_x.api import FinishReason, RequestOutput


def finish_reason(out: RequestOutput) -> str:
    """OpenAI's finish reason of a choice that succeeded: "length" (max_tokens or the
    context) or "stop" (anything else that ended it; failures never get here, see
    frontend/openai/failures.py)."""
    return "length" if out.finish_reason is FinishReason.LENGTH else "stop"


class ResponseBuilder:
    def __init__(self, gen: GenerationRequest, text_of: TokenText, decode) -> None:
        """decode(token ids) -> text: the prompt's text where the client sent token ids."""
        self.gen, self.chat, self.model = gen, gen.chat, gen.model
        self.id = ("chatcmpl-" if gen.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text_of, self.echo, self.score_only = text_of, gen.echo, gen.score_only
        self.prompt_texts = (
            [c.prompt_text if c.prompt_text is not None else decode(c.prompt) for c in gen.choices]
            if gen.echo
            else []
        )
        self._offsets: dict[int, int] = {}  # streaming: text offset of a choice's next token
        self.echoed: set[int] = set()  # streaming with echo: choices whose prompt was sent

    def completion_text(self, index: int, out: RequestOutput) -> str:
        prefix = self.prompt_texts[index] if self.echo else ""
        return prefix + ("" if self.score_only else out.text)

    def logprobs(self, index: int, out: RequestOutput, new_only: bool = False) -> dict | None:
        """The choice's logprobs object for `out` (its new tokens only when streaming)."""
        if out.logprobs is None:
            return None
        entries = out.new_logprobs if new_only else out.logprobs
        if self.chat:
            return chat_logprobs(self.text_of, entries)
        ids = out.new_token_ids if new_only else out.token_ids
        if self.score_only:
            ids, entries = [], []
        offset = 0
        if new_only:  # offsets continue across a choice's chunks
            start = len(self.prompt_texts[index]) if self.echo else 0
            offset = self._offsets.get(index, start)
            self._offsets[index] = offset + sum(len(self.text_of(t)) for t in ids)
        if self.echo and not new_only:
            ids = list(out.prompt_token_ids) + list(ids)
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + list(
                entries
            )
        return completion_logprobs(self.text_of, ids, entries, offset)

    def prompt_chunk_logprobs(self, out: RequestOutput) -> dict | None:
        """Streaming with echo: the prompt's logprobs, sent with the echoed prompt."""
        if out.logprobs is None:
            return None
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return completion_logprobs(self.text_of, out.prompt_token_ids, entries, 0)

    def completion_tokens(self, outs) -> int:
        return 0 if self.score_only else sum(len(o.token_ids) for o in outs)

    def usage(self, completion_tokens: int) -> dict:
        prompt = self.gen.prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
        }

    def full_response(self, finals: list[RequestOutput]) -> dict:
        choices = [self._choice(i, out) for i, out in enumerate(finals)]
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(self.completion_tokens(finals)),
        }

    def _choice(self, i: int, out: RequestOutput) -> dict:
        choice: dict = {"index": i}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = self.completion_text(i, out)
        choice["logprobs"] = self.logprobs(i, out)
        choice["finish_reason"] = finish_reason(out)
        return choice

    def chunk(
        self,
        index: int,
        text: str | None,
        reason: str | None,
        first: bool = False,
        logprobs: dict | None = None,
    ) -> dict:
        if self.chat:
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({"content": text} if text else {})
            )
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
