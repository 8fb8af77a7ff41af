"""A connection to a host that can no longer be reached fails within DDL_MAGIC_PEER_TIMEOUT,
idle or in the middle of sending: a real link, in a network namespace of its own, is cut.

Needs root (network namespaces, a veth pair); skips with the reason elsewhere.
"""

import errno
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from ddl_magic.wire.channel import PEER_TIMEOUT_VARIABLE, peer_timeout_s, tune_socket

PEER_TIMEOUT_S = 3
SLACK_S = 2  # this test's own thread may be slow to wake on a busy machine

# The far end: accepts one connection, then only keeps it open (reads nothing, answers
# nothing) until the test kills it.
LISTENER = """
import socket, sys, threading
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
threading.Event().wait()
"""


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=30)


@pytest.fixture
def far_host():
    """(address, port) of a listener in a network namespace reached over a veth pair, and a
    function that cuts the link."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("cutting a link needs root and iproute2 (network namespaces, veth pairs)")
    tag = f"{os.getpid() % 100000}"
    namespace, outside, inside = f"ddl{tag}", f"ddlo{tag}", f"ddli{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    try:
        run("ip", "netns", "add", namespace)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc.stderr.decode().strip()}")
    listener = None
    try:
        run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        run("ip", "link", "set", inside, "netns", namespace)
        run("ip", "addr", "add", f"{subnet}.1/30", "dev", outside)
        run("ip", "link", "set", outside, "up")
        run("ip", "netns", "exec", namespace, "ip", "addr", "add", f"{subnet}.2/30", "dev", inside)
        run("ip", "netns", "exec", namespace, "ip", "link", "set", inside, "up")
        run("ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        listener = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, "-c",
                                     LISTENER, f"{subnet}.2"], stdout=subprocess.PIPE, text=True)
        port = int(listener.stdout.readline())
        yield (f"{subnet}.2", port), lambda: run("ip", "link", "set", outside, "down")
    finally:
        if listener is not None:
            listener.kill()
            listener.wait(timeout=10)
        subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


@pytest.fixture
def short_peer_timeout(monkeypatch):
    monkeypatch.setenv(PEER_TIMEOUT_VARIABLE, str(PEER_TIMEOUT_S))


def connected(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    tune_socket(sock)
    sock.settimeout(None)  # only the kernel's deadline may end the waits below
    return sock


@pytest.mark.parametrize("sending", [False, True], ids=["idle", "sending"])
def test_a_cut_link_fails_the_connection_within_the_peer_timeout(far_host, short_peer_timeout,
                                                                 sending):
    address, cut = far_host
    with connected(address) as sock:
        cut()
        cut_at = time.monotonic()
        with pytest.raises(OSError) as failure:
            if sending:  # data waits for an acknowledgement that never comes
                while True:
                    sock.sendall(b"x" * 65536)
            else:
                sock.recv(1)
        elapsed = time.monotonic() - cut_at
    assert failure.value.errno == errno.ETIMEDOUT
    assert elapsed < PEER_TIMEOUT_S + SLACK_S, f"noticed after {elapsed:.1f} s"


def test_the_peer_timeout_is_one_setting_with_a_clear_error(monkeypatch):
    monkeypatch.delenv(PEER_TIMEOUT_VARIABLE, raising=False)
    assert peer_timeout_s() == 10.0
    monkeypatch.setenv(PEER_TIMEOUT_VARIABLE, "25")
    assert peer_timeout_s() == 25.0
    for bad, message in (("soon", "is not a number of seconds"), ("0.5", "at least 2 seconds")):
        monkeypatch.setenv(PEER_TIMEOUT_VARIABLE, bad)
        with pytest.raises(ValueError, match=message):
            peer_timeout_s()
