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


def reference(tok) -> Detokenizer:
    """The whole output re-decoded each step: what the incremental decode must equal."""
    d = Detokenizer(tok)
    d.backend = None
    return d


def test_incremental_equals_whole_decodes(tiny_model_dir):
    """Random ids (broken UTF-8 among them), special tokens skipped or kept, stop strings:
    every step's delta, match and text equal the whole-output reference's."""
    import random

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fast, ref = Detokenizer(tok), reference(tok)
    assert fast.backend is not None
    rng = random.Random(0)
    text_ids = tok.encode("héllo wörld ☃ 日本語 😀 " * 3)
    for trial in range(150):
        n = rng.randint(1, 40)
        ids = [rng.randrange(len(tok)) for _ in range(n)] if trial % 2 else text_ids[:n]
        skip, stop = trial % 3 == 0, ("ab", "☃") if trial % 4 == 0 else ()
        for i in range(1, n + 1):
            want = ref.update("r", ids[:i], stop, False, skip, final=i == n)
            got = fast.update("r", ids[:i], stop, False, skip, final=i == n)
            assert got == want and fast.text("r") == ref.text("r"), (trial, i)
            if want[1]:
                break
        fast.drop("r")
        ref.drop("r")


def test_text_of_whole_characters_takes_one_stream_step_a_token(tiny_model_dir):
    """On text, every token goes through the request's DecodeStream only: no window is
    decoded from Python (the slower path is for incomplete characters)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    d = Detokenizer(tok)
    windows = []
    window = d._window
    d._window = lambda *a: windows.append(1) or window(*a)
    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 5)
    for i in range(1, len(ids) + 1):
        d.update("r", ids[:i], (), False, True, final=i == len(ids))
    assert d.text("r") == tok.decode(ids, skip_special_tokens=True)
    assert windows == [] and d.states["r"].fed == len(ids)
    broken = tok.encode("ö")  # two byte tokens: the first waits for the second
    d.update("s", broken[:1], (), False, True, final=False)
    assert windows == [1] and d.text("s") == ""


def test_a_step_decodes_a_window_not_the_output(tiny_model_dir):
    """Without a stream (here: a backend DecodeStream cannot take, as when a decoder's
    window text does not extend its context's), each step hands the backend a few ids,
    however long the output: the cost of a step does not grow with the output (the
    reference decoded all of it every step)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    d = Detokenizer(tok)
    lengths = []
    decode = d.backend.decode

    class Counting:
        def decode(self, ids, skip_special_tokens):
            lengths.append(len(ids))
            return decode(ids, skip_special_tokens=skip_special_tokens)

    d.backend = Counting()
    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 20)
    assert len(ids) > 100
    for i in range(1, len(ids) + 1):
        d.update("r", ids[:i], (), False, True, final=False)
    assert d.text("r") == tok.decode(ids, skip_special_tokens=True)
    assert max(lengths) <= 4


def test_migrated_request_goes_on_as_if_it_had_not_moved(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("a multi tenant lora server ☃ batches many adapters")
    straight, moved = Detokenizer(tok), Detokenizer(tok)
    pieces = [straight.update("r", ids[:i], (), False, True, False)[0] for i in range(1, 9)]
    moved.prime("r", ids[:8], True, emitted=len("".join(pieces)))
    for i in range(9, len(ids) + 1):
        final = i == len(ids)
        assert moved.update("r", ids[:i], (), False, True, final) == straight.update(
            "r", ids[:i], (), False, True, final
        )
    assert moved.text("r") == straight.text("r") == tok.decode(ids, skip_special_tokens=True)


def test_tokenizers_that_clean_up_spaces_decode_whole(tiny_model_dir):
    """A decode that cleans up spaces is not the backend's: such tokenizers keep the
    reference path (exact, slower) rather than an incremental one that would differ."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.clean_up_tokenization_spaces = True
    assert Detokenizer(tok).backend is None
