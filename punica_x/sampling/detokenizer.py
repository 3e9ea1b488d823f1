"""Incremental detokenization with stop strings.

Each step decodes only the request's newest tokens: a window from the last point where the
text was complete (vLLM's incremental detokenizer does the same), in the tokenizer's Rust
backend through tokenizers' DecodeStream (one call a token: 0.5 us, against 1.7 for the
window's two decodes from Python), so a step costs microseconds whatever the output's length
(re-decoding the whole output each step cost ~25 us a request a step at 64 tokens). While a
token leaves an incomplete character the stream says nothing, and the window is decoded here
to stream the complete characters before it. The window
keeps the previous chunk's tokens as context (a SentencePiece decoder strips a leading space
from a text's first token), and its text is the whole text's: exact for byte-level BPE and
Metaspace decoders, where a prefix's text is a prefix of the whole. Tokenizers without a fast
backend, or whose decode cleans up spaces, re-decode the whole output (the reference).

A trailing U+FFFD (an incomplete UTF-8 sequence) is held back until it completes (shown as
decode shows it when the request ends there). While a request runs, the last len(longest stop)
- 1 characters are held back too, so a stop string is never streamed before it is recognised.
A step that does not check stop strings (SamplingParams.min_tokens not reached) still holds
them back, and a stop string counts only if it ends after the text of such steps."""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"


@dataclass
class DetokenizerState:
    text: str = ""  # final text so far (stop string already cut)
    emitted: int = 0  # characters of `text` already streamed
    unchecked: int = 0  # characters of `text` in which a stop string does not count
    # the incremental decode: `done` is the text of ids[:read], complete characters only;
    # ids[prefix:read] the context the next window starts from
    done: str = ""
    prefix: int = 0
    read: int = 0
    # tokenizers' DecodeStream over ids[prefix:]; False: it failed, windows decoded here
    stream: object | None = None
    fed: int = 0  # ids the stream has been given


@dataclass
class Detokenizer:
    """tokenizer: a transformers tokenizer. States are per request id."""

    tokenizer: object
    states: dict[str, DetokenizerState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.backend = fast_backend(self.tokenizer)  # None: whole-output decodes

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
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = DetokenizerState()
        elif not stop and st.stream and st.read == st.fed == len(token_ids) - 1:
            new = self._next_piece(st, token_ids)
            if new is not None:
                return new, None
        text = self._decode(st, token_ids, skip_special, final)
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

    def _next_piece(self, st: DetokenizerState, ids: list[int]) -> str | None:
        """update's common step, without stop strings: a live stream whose text was complete
        before ids' last token takes that token; returns the new text as update would, or None
        when the stream holds the token or fails (st then as _decode leaves it, for update's
        general path to go on from: the window decoded here)."""
        n = len(ids)
        st.fed = n
        try:
            piece = st.stream.step(self.backend, ids[-1])
        except Exception:  # as _decode: this request goes on with the windows decoded here
            st.stream = False
            return None
        if piece is None:
            return None
        st.done += piece
        st.prefix, st.read = st.read, n
        text = st.text = st.done
        upto = max(st.emitted, len(text))
        new, st.emitted = text[st.emitted : upto], upto
        return new

    def prime(
        self, request_id: str, token_ids: list[int], skip_special: bool, emitted: int
    ) -> None:
        """State of a request that continues here (migration): its text so far, of which the
        caller already has `emitted` characters. A stop string would have ended it, so none is
        in the text that counts (min_tokens: none counts in the text so far)."""
        st = DetokenizerState()
        text = self._decode(st, token_ids, skip_special, final=False)
        st.text, st.emitted, st.unchecked = text, emitted, len(text)
        self.states[request_id] = st

    def _decode(self, st: DetokenizerState, ids: list[int], skip_special: bool, final: bool) -> str:
        """The text of all of `ids` (the request's output so far), a trailing U+FFFD held back
        unless final; st's incremental part advanced past the new ids."""
        if self.backend is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=skip_special)
            return text if final else text.rstrip(REPLACEMENT)
        if st.read > len(ids):  # shorter than before: never in a step; start again
            st.done, st.prefix, st.read, st.stream, st.fed = "", 0, 0, None, 0
        if st.stream is None:
            from tokenizers.decoders import DecodeStream

            st.stream = DecodeStream(skip_special_tokens=skip_special)
        if st.stream is not False:
            try:
                for i in range(st.fed, len(ids)):  # one id a step
                    st.fed = i + 1
                    piece = st.stream.step(self.backend, ids[i])
                    if piece is not None:  # the stream moved its window as _window would
                        st.done += piece
                        st.prefix, st.read = st.read, i + 1
            except Exception:  # a decoder whose text of a window is not its context's and more
                st.stream = False  # this request goes on with the windows decoded here
        if st.read == len(ids):
            return st.done
        return self._window(st, ids, skip_special, final)

    def _window(self, st: DetokenizerState, ids: list[int], skip_special: bool, final: bool) -> str:
        """The text of `ids` from the window ids[st.prefix:] (ids[prefix:read] its context)
        decoded here: while the stream holds a token (an incomplete character, a skipped
        special token) or for a request the stream failed. A window whose text is complete
        moves it on (without a stream; a stream moves its own)."""
        decode = self.backend.decode
        context = decode(ids[st.prefix : st.read], skip_special_tokens=skip_special)
        window = decode(ids[st.prefix :], skip_special_tokens=skip_special)
        new = window[len(context) :]
        if st.stream is False and new and not new.endswith(REPLACEMENT):
            st.done += new
            st.prefix, st.read = st.read, len(ids)
            return st.done
        return st.done + (new if final else new.rstrip(REPLACEMENT))

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


def fast_backend(tokenizer):
    """The tokenizers.Tokenizer behind a transformers tokenizer whose decode is exactly the
    backend's (no clean-up of spaces, _decode not overridden); None otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers: no guarantee of what decode adds
        return None
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return backend
