"""Incremental detokenization with stop strings.

Text is re-decoded from the generated ids each step (exact for byte-level BPE, where a
prefix's text is a prefix of the whole) and a trailing U+FFFD (an incomplete UTF-8
sequence) is held back. While a request runs, the last len(longest stop) - 1 characters are
held back too, so a stop string is never streamed before it is recognised. A step that does not
check stop strings (SamplingParams.min_tokens not reached) still holds them back, and a stop
string counts only if it ends after the text of such steps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DetokenizerState:
    text: str = ""  # final text so far (stop string already cut)
    emitted: int = 0  # characters of `text` already streamed
    unchecked: int = 0  # characters of `text` in which a stop string does not count


@dataclass
class Detokenizer:
    tokenizer: object
    states: dict[str, DetokenizerState] = field(default_factory=dict)

    def update(
        self,
        request_id: str,
        token_ids: list[int],
        stop: tuple[str, ...],
        include_stop: bool,
        skip_special: bool,
        final: bool,
        check_stop: bool = True,
    ) -> tuple[str, str | None]:
        """Returns (new text to stream, matched stop string or None). check_stop=False: no
        stop string can match in the text so far (still held back as if it could)."""
        st = self.states.setdefault(request_id, DetokenizerState())
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special)
        if text.endswith("\ufffd") and not final:
            text = text.rstrip("\ufffd")
        matched = None
        if stop and check_stop:
            start = max(0, len(st.text) - max(map(len, stop)) + 1)
            hits = [(_find_after(text, s, start, st.unchecked), s) for s in stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, matched = min(hits)
                text = text[: index + (len(matched) if include_stop else 0)]
        elif stop:
            st.unchecked = len(text)
        st.text = text
        done = final or matched is not None
        hold = 0 if done or not stop else max(map(len, stop)) - 1
        upto = max(st.emitted, len(text) - hold)
        new = text[st.emitted : upto]
        st.emitted = upto
        return new, matched

    def prime(
        self, request_id: str, token_ids: list[int], skip_special: bool, emitted: int
    ) -> None:
        """State of a request that continues here (migration): its text so far, of which the
        caller already has `emitted` characters. A stop string would have ended it, so none is
        in the text that counts (min_tokens: none counts in the text so far)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special)
        text = text.rstrip("\ufffd")
        self.states[request_id] = DetokenizerState(text, emitted, unchecked=len(text))

    def emitted(self, request_id: str) -> int:
        st = self.states.get(request_id)
        return st.emitted if st else 0

    def text(self, request_id: str) -> str:
        st = self.states.get(request_id)
        return st.text if st else ""

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)


def _find_after(text: str, stop: str, start: int, floor: int) -> int:
    """The first index >= start of `stop` in `text` that ends after `floor`; -1 if none."""
    return text.find(stop, max(start, floor - len(stop) + 1))
