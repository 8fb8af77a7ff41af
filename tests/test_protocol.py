"""The handshake: both sides prove the run's secret before anything is unpickled."""

import pickle
import socket
import threading

import pytest

from ddl_magic.wire.channel import AuthenticationError, Channel, PeerClosedError, new_secret


@pytest.fixture
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    yield sock
    sock.close()


def serve_once(listener, secret, purposes, results):
    sock, _ = listener.accept()
    try:
        channel, purpose = Channel.accept(sock, secret, purposes, timeout=5)
        results.append((purpose, channel.recv()))
        channel.send("pong")
    except (AuthenticationError, OSError, PeerClosedError) as exc:
        results.append(exc)


def start_server(listener, secret, purposes=frozenset({"control"})):
    results = []
    thread = threading.Thread(target=serve_once, args=(listener, secret, set(purposes), results))
    thread.start()
    return thread, results


def test_matching_secrets_exchange_messages(listener):
    secret = new_secret()
    thread, results = start_server(listener, secret)
    channel = Channel.connect(listener.getsockname(), secret, "control", timeout=5)
    channel.send({"hello": 1})
    assert channel.recv() == "pong"
    thread.join(5)
    assert results == [("control", {"hello": 1})]


def test_wrong_secret_is_refused_by_both_sides(listener):
    thread, results = start_server(listener, new_secret())
    with pytest.raises((AuthenticationError, PeerClosedError, ConnectionError)):
        Channel.connect(listener.getsockname(), new_secret(), "control", timeout=5)
    thread.join(5)
    assert isinstance(results[0], AuthenticationError)


def test_proof_is_bound_to_its_purpose(listener):
    secret = new_secret()
    thread, results = start_server(listener, secret, purposes={"ring"})
    with pytest.raises((AuthenticationError, PeerClosedError, ConnectionError)):
        Channel.connect(listener.getsockname(), secret, "control", timeout=5)
    thread.join(5)
    assert isinstance(results[0], AuthenticationError)


class Bomb:
    """Unpickling this would record that the server unpickled attacker data."""

    def __reduce__(self):
        return (print, ("UNPICKLED",))


def test_garbage_and_pickles_before_the_handshake_are_never_unpickled(listener, capsys):
    thread, results = start_server(listener, new_secret())
    client = socket.create_connection(listener.getsockname(), timeout=5)
    client.recv(64)  # the server's hello
    data = pickle.dumps(Bomb())
    client.sendall(len(data).to_bytes(8, "big") + data)
    thread.join(5)
    client.close()
    assert isinstance(results[0], AuthenticationError)
    assert "UNPICKLED" not in capsys.readouterr().out


def test_oversized_handshake_frame_is_refused_without_reading_it(listener):
    thread, results = start_server(listener, new_secret())
    client = socket.create_connection(listener.getsockname(), timeout=5)
    client.sendall((1 << 40).to_bytes(8, "big"))  # claims a terabyte
    thread.join(5)
    client.close()
    assert isinstance(results[0], AuthenticationError)
