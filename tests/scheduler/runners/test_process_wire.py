"""What crosses between the scheduler and an engine process (process_wire.py): outputs and
events come back equal, errors come back as their own type with their attributes, and what
cannot be rebuilt or pickled comes back as a RuntimeError saying what it was."""

from __future__ import annotations

import pickle

import pytest

from punica_x.core import FinishReason, RequestOutput, TokenLogprob
from punica_x.lora.peft_errors import AdapterError
from punica_x.lora.pool import UnknownAdapterError
from scheduler.runners import process_wire as wire
from scheduler.runners.ray_events import LostEvent, OutputEvent, PreemptEvent


def test_outputs_and_events_round_trip():
    lp = [TokenLogprob(5, -0.25, ((5, -0.25), (9, -2.0)))]
    final = RequestOutput(
        "r", [1, 2], [5], "hi", [5], "hi", True, FinishReason.STOP, "hi", None, lp, lp, [None]
    )
    middle = RequestOutput("r", [], [], "", [7], "!", False)
    events = [OutputEvent(1, "r", middle), OutputEvent(2, "r", final), PreemptEvent(3, "q")]
    events.append(LostEvent(4, "q", "engine step failed", True))
    back = wire.decode(wire.encode(events))
    assert back == events and back[1].output.finish_reason is FinishReason.STOP
    assert pickle.loads(pickle.dumps(final, 5)) == final  # Ray pickles them too


def test_errors_cross_as_their_own_type():
    ok, payload = wire.decode(wire.encode_reply(False, AdapterError("sha256_mismatch", "bad")))
    err = payload.rebuild()
    assert not ok and type(err) is AdapterError and err.code == "sha256_mismatch"
    assert str(err) == "bad"
    err = wire.decode(wire.encode_reply(False, UnknownAdapterError("nope")))[1].rebuild()
    assert type(err) is UnknownAdapterError and err.name == "nope" and "nope" in str(err)


def test_what_cannot_be_rebuilt_or_pickled_says_what_it_was():
    gone = wire.ErrorPayload("no.such.module", "Oops", ("it broke",), {}).rebuild()
    assert isinstance(gone, RuntimeError) and "Oops: it broke" in str(gone)
    not_an_error = wire.ErrorPayload("builtins", "dict", (), {}).rebuild()
    assert isinstance(not_an_error, RuntimeError)
    ok, payload = wire.decode(wire.encode_reply(True, lambda: None))  # a result pickle refuses
    assert not ok
    with pytest.raises(RuntimeError, match="unpicklable reply"):
        raise payload.rebuild()


def test_an_address_is_a_private_ipc_socket():
    import os
    import shutil
    import stat

    address, folder = wire.new_address("runner-x")
    try:
        assert address == f"ipc://{folder}/engine.sock"
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        shutil.rmtree(folder)


def test_calls_of_one_turn_cross_as_one_message():
    alone = [(b"id1", wire.encode(("poll", (0,))))]
    assert wire.frames(alone) == [b"id1", alone[0][1]]
    assert wire.pairs(*wire.frames(alone)) == alone
    several = alone + [(b"", wire.encode(("abort", ("r",)))), (b"id2", b"\x00" * 40_000)]
    message = wire.frames(several)
    assert message[0] == wire.BATCH and len(message) == 2
    assert wire.pairs(*message) == several
