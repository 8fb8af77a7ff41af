"""Random, truncated and oversized frames thrown at the driver's control port during a run
and at a rank's ring listener while the ring forms, before the handshake and after it: every
connection is refused or dropped, no server thread raises, and the run goes on correctly."""

import pickle
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ranks import run_on_ranks

LENGTH = struct.Struct("!Q")  # the protocol's frame header
EXAMPLES = 100  # the same examples every run (derandomize): CI stays deterministic
EXPECTED_RANK = 3  # the one peer the fuzzed ring listener waits for


def frame(body: bytes) -> bytes:
    return LENGTH.pack(len(body)) + body


raw_frames = st.one_of(
    st.binary(max_size=400),  # no framing at all
    st.builds(frame, st.binary(max_size=300)),  # a well-formed frame of garbage
    st.builds(lambda extra, body: LENGTH.pack(len(body) + extra) + body,  # truncated
              st.integers(1, 1 << 20), st.binary(max_size=64)),
    st.builds(lambda length, body: LENGTH.pack(length) + body,  # oversized
              st.integers(1 << 32, (1 << 64) - 1), st.binary(max_size=64)),
)


def message_classes():
    """Every message class of the protocol, with how many fields each takes."""
    import dataclasses

    from ddl_magic.wire import messages

    return [(cls, len(dataclasses.fields(cls))) for cls in vars(messages).values()
            if isinstance(cls, type) and dataclasses.is_dataclass(cls)
            and cls.__module__ == messages.__name__]


# Pickled objects of every shape, some of them the servers' own messages with fields of any
# type and value.
messages = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.sampled_from(message_classes()).flatmap(
                       lambda kind: st.builds(kind[0], *[inner] * kind[1]))),
    max_leaves=8,
).filter(lambda message: message != EXPECTED_RANK)
after_handshake = st.one_of(raw_frames, st.builds(lambda m: frame(pickle.dumps(m)), messages))


def throw(address, data: bytes, secret: bytes | None = None, purpose: str = "") -> None:
    """Send `data` (after proving `secret`, if given), stop sending, and require the server to
    close the connection within the handshake timeout: nothing hangs on a bad peer."""
    from ddl_magic.wire.channel import Channel

    if secret is None:
        sock = socket.create_connection(address, timeout=15)
    else:
        sock = Channel.connect(address, secret, purpose, timeout=15).sock
        sock.settimeout(15)
    with sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass  # a hello, a clock answer: the server may speak before it hangs up
        except socket.timeout:
            raise AssertionError(f"the server kept a bad peer's connection open: {data[:40]!r}")
        except OSError:
            pass  # reset or closed mid-send: refused


def throw_strangers_and_garbage(address, secret: bytes, purposes: list[str]) -> None:
    """Every example: a stranger's bytes, then bytes after a proper handshake."""

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(before=raw_frames, after=after_handshake, purpose=st.sampled_from(purposes))
    def strangers_and_garbage(before, after, purpose):
        throw(address, before)
        throw(address, after, secret, purpose)

    strangers_and_garbage()


def fuzz_the_control_port_then_allreduce():
    import torch

    import ddl_magic.torch as hvd
    from ddl_magic.rank import worker
    from ddl_magic.runtime import context

    hvd.init()
    if hvd.rank() == 0:
        throw_strangers_and_garbage(worker.control.sock.getpeername(), context.bootstrap.secret,
                                    ["control", "task"])
    return hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist()


@pytest.fixture
def thread_exceptions(monkeypatch):
    """Every exception that escapes a thread of this process while the test runs."""
    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    return escaped


def test_the_control_port_refuses_every_bad_frame_and_the_run_goes_on(thread_exceptions):
    results = run_on_ranks(fuzz_the_control_port_then_allreduce, 2, timeout_s=240)
    assert results == [[2.0, 2.0, 2.0]] * 2
    assert thread_exceptions == []


def test_a_ring_listener_refuses_every_bad_frame_and_still_accepts_its_peer(thread_exceptions):
    from ddl_magic.wire.channel import Channel, new_secret
    from ddl_magic.runtime.rendezvous import _accept_expected

    secret, accepted = new_secret(), {}
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        address = listener.getsockname()
        acceptor = threading.Thread(target=_accept_expected, daemon=True, args=(
            listener, secret, {("ring", EXPECTED_RANK)}, accepted, time.monotonic() + 120))
        acceptor.start()
        throw_strangers_and_garbage(address, secret, ["ring", "coord"])
        assert accepted == {}
        peer = Channel.connect(address, secret, "ring", timeout=15)
        peer.send(EXPECTED_RANK)
        acceptor.join(timeout=30)
        assert not acceptor.is_alive()
        assert list(accepted) == [("ring", EXPECTED_RANK)]
        peer.close()
        accepted[("ring", EXPECTED_RANK)].close()
    assert thread_exceptions == []
