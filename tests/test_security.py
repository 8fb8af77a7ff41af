"""The run's secret: it never shows in a rank's command line or environment, and strangers at
the driver's control port are refused while the run goes on unharmed."""

import os
import queue
import socket

from ddl_magic.launch.local import LocalLauncher
from ddl_magic.wire.channel import new_secret
from ranks import run_on_ranks


def test_the_secret_is_not_in_any_ranks_command_line_or_environment():
    silent_driver = socket.socket()  # accepts connections, never answers: ranks wait there
    silent_driver.bind(("127.0.0.1", 0))
    silent_driver.listen(8)
    secret = new_secret()
    launcher = LocalLauncher()
    launcher.start(2, silent_driver.getsockname(), secret, queue.Queue())
    try:
        for pid in launcher.pids:
            for view in ("cmdline", "environ"):
                with open(f"/proc/{pid}/{view}", "rb") as f:
                    seen = f.read()
                assert secret not in seen and secret.hex().encode() not in seen, view
    finally:
        launcher.stop()
        silent_driver.close()


def knock_on_the_control_port_then_allreduce():
    import torch

    import ddl_magic.torch as hvd
    from ddl_magic.rank import worker

    hvd.init()
    if hvd.rank() == 0:
        host, port = worker.control.sock.getpeername()  # the driver's control port
        with socket.create_connection((host, int(port))) as garbage:
            garbage.sendall(b"\x00\x00\x00\x00\x00\x00\x00\x10not a handshake")
        with socket.create_connection((host, int(port))) as impostor:
            impostor.recv(64)
            impostor.sendall((71).to_bytes(8, "big") + os.urandom(64) + b"control")
            refused = impostor.recv(64) == b""
    else:
        refused = True
    return refused, hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist()


def test_strangers_at_the_control_port_are_refused_and_the_run_goes_on():
    results = run_on_ranks(knock_on_the_control_port_then_allreduce, 2)
    assert results == [(True, [2.0, 2.0, 2.0])] * 2
