"""Token texts in logprobs: each token's own bytes, distinct tokens never sharing a text."""

from __future__ import annotations

from frontend.openai.logprobs_format import TokenText


def test_token_bytes_rebuild_the_text_and_partial_characters_are_named(srv_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(srv_model_dir)
    text_of = TokenText(tok)
    text = "héllo wörld € 😀 naïve"
    ids = tok(text, add_special_tokens=False).input_ids
    assert b"".join(text_of.raw(t) for t in ids) == text.encode()
    pieces = [text_of(t) for t in ids]
    assert any(p.startswith("bytes:\\x") for p in pieces)  # the emoji spans several tokens
    by_text: dict[str, set[bytes]] = {}
    for t in range(len(tok)):
        by_text.setdefault(text_of(t), set()).add(text_of.raw(t))
    assert all(len(raws) == 1 for raws in by_text.values())  # one text, one byte string
