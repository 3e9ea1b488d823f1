"""The channel between the scheduler and an engine process (process_runner.py,
process_main.py): ZeroMQ (pyzmq) over an ipc socket in a private directory, one message per
call and one per reply, each a pickled tuple.

A call is [call id, pickle((method, args))]; an empty call id asks for no reply (abort,
stop_lending). A reply is [call id, pickle((ok, value))]: the method's result, or with
ok False the exception it raised as an ErrorPayload, rebuilt on this side as the same type
(ValueError, UnknownAdapterError, AdapterError with its code...) so callers handle it as
they would a thread runner's.

Calls made on one turn of an event loop go as one message, and so do the replies answered
on one turn: [BATCH, pickle([(call id, body), ...])], each body as above. An admission burst
of 256 opens was 256 sends each way, ~35 us of interpreter apiece and a wake-up of the other
process each time; it is a few messages now.

Why pickle: the messages are the same frozen dataclasses a Ray runner's actor calls carry
(EngineRequest, Resume with its KV tensor, the ray_events), and on them pickle measured
faster than msgspec's typed msgpack (256 step outputs: 0.46 ms to encode and 0.59 to decode,
against 0.11 and 0.99; AMX Xeon). Both ends are this program: the socket's directory is
readable by this user only, and nothing a tenant sends is unpickled."""

from __future__ import annotations

import importlib
import os
import pickle
import tempfile
from dataclasses import dataclass

PROTOCOL = 5
BATCH = b"*"  # the call id of a message that carries several calls (or replies)


@dataclass(frozen=True)
class ErrorPayload:
    """An exception as it crosses: its class (module, qualified name), args and attributes."""

    module: str
    qualname: str
    args: tuple
    attrs: dict

    @classmethod
    def of(cls, exc: BaseException) -> ErrorPayload:
        attrs = {k: v for k, v in vars(exc).items() if _picklable(v)}
        args = tuple(a if _picklable(a) else repr(a) for a in exc.args)
        return cls(type(exc).__module__, type(exc).__qualname__, args, attrs)

    def rebuild(self) -> BaseException:
        """The exception again; a RuntimeError saying what it was when its class cannot be
        found or made here."""
        try:
            kind = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                kind = getattr(kind, part)
            if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                raise TypeError(self.qualname)
            exc = kind.__new__(kind)
            exc.args = self.args
            exc.__dict__.update(self.attrs)
            return exc
        except Exception:
            return RuntimeError(f"{self.qualname}: {', '.join(map(str, self.args))}")


def _picklable(value) -> bool:
    try:
        pickle.dumps(value, protocol=PROTOCOL)
    except Exception:
        return False
    return True


def encode(value) -> bytes:
    return pickle.dumps(value, protocol=PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)


def frames(pairs: list[tuple[bytes, bytes]]) -> list[bytes]:
    """The frames of one message carrying `pairs` of (call id, body): a lone pair as itself."""
    if len(pairs) == 1:
        return list(pairs[0])
    return [BATCH, encode(pairs)]


def pairs(call_id: bytes, body: bytes) -> list[tuple[bytes, bytes]]:
    """The (call id, body) pairs of a message received as [call_id, body]."""
    return decode(body) if call_id == BATCH else [(call_id, body)]


def encode_reply(ok: bool, value) -> bytes:
    """A reply's body; a result that cannot be pickled becomes an error saying so."""
    if not ok:
        value = ErrorPayload.of(value)
    try:
        return encode((ok, value))
    except Exception as exc:
        return encode((False, ErrorPayload.of(RuntimeError(f"unpicklable reply: {exc}"))))


def new_address(runner_id: str) -> tuple[str, str]:
    """(ipc address, its directory): a directory only this user can enter (mkdtemp's 0700)."""
    folder = tempfile.mkdtemp(prefix=f"punica-x-{runner_id}-")
    os.chmod(folder, 0o700)
    return f"ipc://{folder}/engine.sock", folder
