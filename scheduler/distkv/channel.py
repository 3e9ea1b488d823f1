"""DistKV's data plane between runner processes: a socket per (debtor, creditor) pair.

A creditor runs a KVChannelServer: it listens on a Unix socket (peers on its node) and on TCP
at its node's address (peers on other nodes), authenticates each connection with the group's
key (multiprocessing.connection's HMAC handshake), and serves each connected debtor on a
thread of its own while its engine steps (the attention kernels release the GIL). A debtor
holds one KVChannel per creditor and sends it, per step, the MicroPlan (pickled, once) and,
per layer, one frame with the query rows and the new tokens' K/V; the reply is (out, lse).
A debtor may prepare several plans with one creditor in a step (the batch-invariant order
sends a request's extents round by round, and one creditor may hold two of them): each plan
has a slot, and each run names the slot of its plan.
KV never travels at decode, and nothing goes through the scheduler or Ray's object store.

Why sockets (benchmarks/bench_kv_transport.py, docs/distkv.md): a Ray actor call costs ~2.8 ms a
round trip on a 2-core AMD EPYC (84 ms per token per creditor at 30 layers); a Unix socket
frame costs tens of microseconds, about what shared memory plus a pipe costs, and the same
code runs over TCP between nodes.

Frames (little endian), one message each way per call:
    prepare  b"P" + slot (u32) + pickle(MicroPlan)          -> b"\\0"
    run      b"R" + _RUN header + q | k | v raw bytes       -> b"\\0" + out | lse raw bytes
    chained  b"C" + _RUN header + q | k | v | state         -> b"\\0" + state raw bytes
    get      b"G" + pickle(block ids)                       -> b"\\0" + pickle(tensor)
    set      b"S" + pickle((block ids, tensor))             -> b"\\0"
    tables   b"T"                                           -> b"\\0" + pickle(block tables)
    counters b"I"                                           -> b"\\0" + pickle((calls, s))
    failure                                                 -> b"\\1" + pickle(exception)
chained runs the batch-invariant order (attention.dist): the attention goes on from the
rows' online-softmax state (float32 [R, H_q, D + 2]) and returns the new one;
get and set serve Lamina's attention workers, whose blocks a model worker swaps and copies;
tables gives the block tables a worker kept from its model worker's plans (the KV of a dead
model worker's requests, scheduler/lamina/rescue.py); counters its attention calls and the
seconds it computed them (benchmarks tell the exchange from the attention with them).
The first message on a connection is the debtor's runner id (pickled). A creditor that is
gone (closed socket, no reply within CALL_TIMEOUT_S, or its rManager stopped) surfaces as
PeerLost on the debtor."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import struct
import tempfile
import threading
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

import torch

from punica_x.api import MicroPlan, PeerLost

CALL_TIMEOUT_S = 30.0
_RUN = struct.Struct("<IdB6I")  # layer, scale, dtype code, R, H_q, D, W, N_kv, slot
_SLOT = struct.Struct("<I")
KEPT_PLANS = 64  # prepared plans a creditor keeps per debtor (the newest; slots wrap at 2**32)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OK, _ERR = b"\0", b"\1"
_BLOCK_FRAMES = (b"G", b"S", b"T", b"I")


@dataclass(frozen=True)
class ChannelAddress:
    """Where a creditor's server listens: `unix` (a socket path, for peers on `node`) and
    `tcp` (host, port) for peers elsewhere."""

    node: str
    unix: str
    tcp: tuple[str, int]


def _no_delay(conn: Connection) -> None:
    """TCP_NODELAY on a TCP connection: multiprocessing writes a large frame's length and
    body separately, and Nagle's algorithm would hold the body for the peer's delayed ACK
    (~40 ms a frame, measured)."""
    with contextlib.suppress(OSError):
        s = socket.socket(fileno=os.dup(conn.fileno()))  # shares the connection's socket
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        finally:
            s.close()


def _shutdown(conn: Connection) -> None:
    """Shut a connection's socket down both ways (a blocked recv returns EOF), leaving the
    close to its owner."""
    s = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        s.shutdown(socket.SHUT_RDWR)
    finally:
        s.close()


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor (any dtype, bfloat16 included, on any device: a GPU's is copied
    to the host first), without a copy when a host tensor is contiguous."""
    t = t.detach().cpu() if t.device.type != "cpu" else t
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _tensor(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over a copy of buf (the frame's bytes object is read-only)."""
    if not len(buf):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(buf), dtype=dtype).view(shape)


def _nbytes(dtype: torch.dtype, *shape: int) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


class KVChannelServer:
    """A creditor's listener. `handler` is its RManager (prepare(debtor, plan) -> an object
    with run(layer, q, k, v, scale) -> (out, lse)). host: the TCP address to bind (the node's
    own address; 127.0.0.1 when every runner is on one machine)."""

    def __init__(self, handler, authkey: bytes, node: str, host: str = "127.0.0.1") -> None:
        if len(authkey) < 16:  # multiprocessing skips the handshake for an empty key
            raise ValueError("a KVChannelServer needs an authkey of at least 16 bytes")
        self.handler = handler
        self._dir = tempfile.mkdtemp(prefix="pxkv-")
        path = os.path.join(self._dir, "s")
        self._listeners = [
            Listener(path, "AF_UNIX", authkey=authkey),
            Listener((host, 0), "AF_INET", authkey=authkey),
        ]
        tcp = self._listeners[1].address
        self.address = ChannelAddress(node, path, (tcp[0], tcp[1]))
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self._closed = False
        self.frames = 0  # requests served (prepare and run frames)
        for lis in self._listeners:
            threading.Thread(target=self._accept, args=(lis,), daemon=True).start()

    def _accept(self, listener: Listener) -> None:
        while not self._closed:
            try:
                conn = listener.accept()
            except Exception:  # closed, or a peer that failed the handshake
                if self._closed:
                    return
                continue
            _no_delay(conn)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            debtor = conn.recv()
            micros: dict[int, object] = {}  # slot -> prepared plan, oldest first
            while True:
                msg = memoryview(conn.recv_bytes())
                self.frames += 1
                try:
                    kind = msg[0:1]
                    if kind == b"P":
                        (slot,) = _SLOT.unpack_from(msg, 1)
                        micros.pop(slot, None)
                        micros[slot] = self.handler.prepare(
                            debtor, pickle.loads(msg[1 + _SLOT.size :])
                        )
                        while len(micros) > KEPT_PLANS:
                            del micros[next(iter(micros))]
                        conn.send_bytes(_OK)
                    elif kind in _BLOCK_FRAMES:
                        conn.send_bytes(_OK + _blocks(self.handler, kind, msg[1:]))
                    elif kind not in (b"R", b"C"):
                        raise ValueError(f"unknown frame kind {bytes(kind)!r}")
                    else:
                        slot = _RUN.unpack_from(msg, 1)[-1]
                        if slot not in micros:
                            raise RuntimeError(f"run before prepare (plan slot {slot})")
                        conn.send_bytes(_run(micros[slot], msg, chained=kind == b"C"))
                except Exception as exc:
                    conn.send_bytes(_ERR + _dump(exc))
        except Exception:  # the debtor left, or close() shut the socket down under recv
            pass
        finally:
            with self._lock:  # closed here only: close() shuts down, never closes (fd reuse)
                self._conns.remove(conn)
            conn.close()

    @property
    def connections(self) -> int:
        """Peers connected now (a model worker holds one connection while it lives)."""
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self._closed = True
        for lis in self._listeners:
            with contextlib.suppress(OSError):
                lis.close()
        with self._lock:
            for c in self._conns:  # their serving threads see EOF and close them
                with contextlib.suppress(OSError):
                    _shutdown(c)
        shutil.rmtree(self._dir, ignore_errors=True)


def _run(micro, msg: memoryview, chained: bool = False) -> bytes:
    layer, scale, code, rows, heads, dim, w, kv_heads, _ = _RUN.unpack_from(msg, 1)
    dtype = _DTYPES[code]
    at = 1 + _RUN.size
    sizes = (_nbytes(dtype, rows, heads, dim), _nbytes(dtype, w, kv_heads, dim))
    q = _tensor(msg[at : at + sizes[0]], dtype, (rows, heads, dim))
    at += sizes[0]
    k = _tensor(msg[at : at + sizes[1]], dtype, (w, kv_heads, dim))
    v = _tensor(msg[at + sizes[1] : at + 2 * sizes[1]], dtype, (w, kv_heads, dim))
    if chained:
        at += 2 * sizes[1]
        shape = (rows, heads, dim + 2)
        if len(msg) - at != _nbytes(torch.float32, *shape):
            raise ValueError(f"a chained run needs its state, float32 {list(shape)}")
        state = micro.run(layer, q, k, v, scale, state=_tensor(msg[at:], torch.float32, shape))
        return b"".join((_OK, _raw(state.to(torch.float32).contiguous())))
    out, lse = micro.run(layer, q, k, v, scale)
    out = out.to(dtype)
    return b"".join((_OK, _raw(out), _raw(lse.to(torch.float32))))


def _blocks(handler, kind: bytes, body: memoryview) -> bytes:
    """A frame for a handler that keeps whole blocks (Lamina's attention workers:
    punica_x/kv/attention_worker.py): b"G" reads blocks (pickle(ids) -> pickle(tensor)),
    b"S" writes them (pickle((ids, tensor)) -> nothing), b"T" and b"I" give its block tables
    and its counters."""
    if kind == b"G":
        return pickle.dumps(handler.read_blocks(pickle.loads(body)))
    if kind == b"T":
        return pickle.dumps(handler.block_tables())
    if kind == b"I":
        return pickle.dumps(handler.counters())
    ids, data = pickle.loads(body)
    handler.write_blocks(ids, data)
    return b""


def _dump(exc: Exception) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


class KVChannel:
    """A debtor's connection to one creditor (`owner`); thread-safe (one call at a time)."""

    def __init__(self, owner: str, address: ChannelAddress, debtor: str, node: str, authkey: bytes):
        self.owner, self.address = owner, address
        self._lock = threading.Lock()
        self._slot = 0  # the next plan's slot
        self.conn: Connection | None = None
        try:
            if address.node == node:
                self.conn = Client(address.unix, "AF_UNIX", authkey=authkey)
            else:
                self.conn = Client(address.tcp, "AF_INET", authkey=authkey)
                _no_delay(self.conn)
            self.conn.send(debtor)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise PeerLost(owner, f"runner {owner} holding borrowed KV blocks: {exc}") from None

    def prepare(self, debtor: str, plan: MicroPlan) -> PreparedPlan:
        """Send a plan over the blocks `owner` lent (KVPeer.prepare); its runs go through
        the PreparedPlan returned (the creditor keeps the newest KEPT_PLANS)."""
        with self._lock:
            slot, self._slot = self._slot, (self._slot + 1) % 2**32
        self._call(b"P" + _SLOT.pack(slot) + pickle.dumps(plan))
        return PreparedPlan(self, slot)

    def run(
        self, layer: int, q, k, v, scale: float, state: torch.Tensor | None = None, slot: int = 0
    ):
        """(out [R, H_q, D] in q's dtype, lse [R, H_q] float32) of q over the blocks of the
        plan prepared in `slot`, after writing k/v [W, N_kv, D] into its slots
        (MicroAttention.run); with `state` ([R, H_q, D + 2] float32), the state going on
        from it instead."""
        rows, heads, dim = q.shape
        w, kv_heads = k.shape[0], k.shape[1] if k.dim() == 3 else 0
        code = _DTYPES.index(q.dtype)
        head = _RUN.pack(layer, scale, code, rows, heads, dim, w, kv_heads, slot)
        parts = [b"R" if state is None else b"C", head, _raw(q)]
        if w:
            parts += [_raw(k.to(q.dtype)), _raw(v.to(q.dtype))]
        if state is not None:
            parts.append(_raw(state.to(torch.float32)))
        reply = self._call(b"".join(parts))
        if state is not None:
            return _tensor(reply[1:], torch.float32, (rows, heads, dim + 2))
        n = _nbytes(q.dtype, rows, heads, dim)
        out = _tensor(reply[1 : 1 + n], q.dtype, (rows, heads, dim))
        lse = _tensor(reply[1 + n :], torch.float32, (rows, heads))
        return out, lse

    def read_blocks(self, ids: list[int]) -> torch.Tensor:
        """The owner's data of blocks `ids` (a peer that keeps whole blocks)."""
        return pickle.loads(self._call(b"G" + pickle.dumps(list(ids)))[1:])

    def write_blocks(self, ids: list[int], data: torch.Tensor) -> None:
        """Write data [len(ids), ...] into the owner's blocks `ids`."""
        self._call(b"S" + pickle.dumps((list(ids), data.contiguous())))

    def block_tables(self) -> dict[str, tuple[int, ...]]:
        """The block tables the owner (an attention worker) kept from its model worker."""
        return pickle.loads(self._call(b"T")[1:])

    def counters(self) -> tuple[int, float]:
        """The owner's (attention calls served, seconds computing them) so far."""
        return pickle.loads(self._call(b"I")[1:])

    def _call(self, frame: bytes) -> memoryview:
        with self._lock:
            conn = self.conn
            if conn is None:
                raise PeerLost(self.owner)
            try:
                conn.send_bytes(frame)
                if not conn.poll(CALL_TIMEOUT_S):
                    raise TimeoutError(f"no reply within {CALL_TIMEOUT_S} s")
                reply = memoryview(conn.recv_bytes())
            except (OSError, EOFError, TimeoutError) as exc:
                self.close()
                raise PeerLost(
                    self.owner, f"runner {self.owner} holding borrowed KV blocks: {exc}"
                ) from None
        if reply[0:1] == _OK:
            return reply
        exc = pickle.loads(reply[1:])
        if isinstance(exc, PeerLost):
            raise PeerLost(self.owner)
        raise exc

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.close()
            self.conn = None


@dataclass(frozen=True)
class PreparedPlan:
    """One plan prepared on a creditor (KVChannel.prepare): run() goes to that plan, whatever
    the debtor prepared with the creditor since."""

    channel: KVChannel
    slot: int

    def run(self, layer: int, q, k, v, scale: float, state: torch.Tensor | None = None):
        return self.channel.run(layer, q, k, v, scale, state, self.slot)
