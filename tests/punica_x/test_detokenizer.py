"""Incremental detokenization: deltas add up, stop strings are cut and never streamed early."""

from transformers import AutoTokenizer

from punica_x.sampling.detokenizer import Detokenizer


def stream(tok, text, stop=(), include=False):
    ids = tok.encode(text)
    d = Detokenizer(tok)
    pieces, matched = [], None
    for i in range(1, len(ids) + 1):
        new, matched = d.update("r", ids[:i], stop, include, True, final=i == len(ids))
        pieces.append(new)
        if matched:
            break
    return pieces, matched, d.text("r")


def test_deltas_add_up_to_the_text(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "héllo wörld, ünïcode ☃ and numbers 0123"
    pieces, matched, full = stream(tok, text)
    assert "".join(pieces) == full == text and matched is None
    assert not any("\ufffd" in p for p in pieces)  # partial UTF-8 is held back


def test_stop_string_is_cut_and_not_streamed(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces, matched, full = stream(tok, "the quick brown fox jumps over", stop=("fox", "zzz"))
    assert matched == "fox" and full == "the quick brown "
    # nothing of the stop string was ever streamed: the pieces add up to the cut text only
    assert "".join(pieces) == full
    # a near miss ("fog") is released, the later "fox" still cut
    pieces, matched, full = stream(tok, "the fog and the fox", stop=("fox",))
    assert matched == "fox" and full == "the fog and the " == "".join(pieces)
    pieces, matched, full = stream(tok, "the quick brown fox jumps", stop=("fox",), include=True)
    assert full == "the quick brown fox" and "".join(pieces) == full
