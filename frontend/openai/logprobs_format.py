"""Logprobs in the OpenAI formats (values: punica_x.sampling.logprobs, the raw model distribution).

Completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
"text_offset": [...]}, with None for the first prompt token under `echo` (it has no context),
text offsets counted in the choice's returned text. Chat: {"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}. A token's text is the UTF-8 of
its own bytes, or `bytes:\\xNN...` when they are part of a character (see TokenText)."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence

from punica_x.api import TokenLogprob

NO_CHANCE = -9999.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


class TokenText:
    """token id -> its bytes and its text, cached (the vocabulary is fixed; one per server,
    shared by its requests: FrontendManager.token_text). A token whose
    bytes are not UTF-8 on their own (part of a character) is named as OpenAI does,
    `bytes:\\xe2\\x80`, so distinct tokens never share a text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._byte_decoder = _byte_level_decoder()

    def __call__(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def raw(self, token_id: int) -> bytes:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, bytes]:
        entry = self._cache.get(token_id)
        if entry is None:
            raw = self._raw_bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            entry = self._cache[token_id] = (text, raw)
        return entry

    def _raw_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            match = _BYTE_TOKEN.match(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            if all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)  # byte-level BPE
        return self.tokenizer.decode([token_id]).encode()


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's character -> byte table (printable bytes map to themselves, the
    rest to U+0100 onwards), as the `tokenizers` ByteLevel pre-tokenizer defines it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def finite(logprob: float) -> float:
    """JSON has no -inf or NaN: a logprob that is not finite (a token the model gives no
    chance, a NaN logit) is reported as vLLM does, -9999.0."""
    return logprob if math.isfinite(logprob) else NO_CHANCE


def completion_logprobs(
    text_of: TokenText,
    token_ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    offset: int = 0,
) -> dict:
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for piece in tokens:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(e.logprob) if e is not None else None for e in entries],
        "top_logprobs": [
            {text_of(t): finite(lp) for t, lp in e.top} if e is not None else None for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(text_of: TokenText, entries: Sequence[TokenLogprob]) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        raw = list(text_of.raw(token_id))
        return {"token": text_of(token_id), "logprob": finite(logprob), "bytes": raw}

    return {
        "content": [
            {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }
