"""The runtime on its own (no driver to stop anyone): a rank that vanishes becomes an error
naming it on every other rank within seconds, and strangers at the ring listener are refused."""

import multiprocessing
import os
import socket
import time

from ddl_magic.wire.channel import new_secret

NP = 3
VANISHING_RANK = 1


def rank_main(rank, secret, listener_ports, peers_queue, results):
    import torch

    from ddl_magic.runtime import context
    from ddl_magic.runtime.errors import HorovodInternalError
    from ddl_magic.runtime.world import Peer

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener_ports.put((rank, listener.getsockname()[1]))
    peers = [Peer(r, "127.0.0.1", ("127.0.0.1", port)) for r, port in sorted(peers_queue.get())]
    context.bootstrap = context.RankBootstrap(rank, peers, secret, listener)
    os.environ["DDL_MAGIC_TIMEOUT"] = "20"
    context.init()
    import ddl_magic.torch as hvd

    tensor = torch.ones(4 * 1024 * 1024)
    try:
        for step in range(1000):
            if rank == VANISHING_RANK and step == 3:
                results.put((rank, "vanishing", time.time()))
                results.close()
                results.join_thread()  # os._exit would otherwise take the queue's lock with it
                os._exit(1)
            hvd.allreduce(tensor)
        results.put((rank, "no error", time.time()))
    except HorovodInternalError as exc:
        results.put((rank, str(exc), time.time()))


def make_noise(ports):
    """A stranger sending garbage and one with a made-up proof, queued at every rank's listener
    before the ring forms, so they are the first connections each rank accepts."""
    strangers = []
    for port in ports:
        garbage = socket.create_connection(("127.0.0.1", port))
        garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" * 10)
        impostor = socket.create_connection(("127.0.0.1", port))
        impostor.sendall((68).to_bytes(8, "big") + os.urandom(64) + b"ring")
        strangers += [garbage, impostor]
    return strangers


def test_every_rank_names_the_lost_peer_and_strangers_do_not_break_the_ring():
    ctx = multiprocessing.get_context("spawn")
    secret = new_secret()
    listener_ports, results = ctx.Queue(), ctx.Queue()
    peer_queues = [ctx.Queue() for _ in range(NP)]
    strangers = []
    ranks = [ctx.Process(target=rank_main, args=(r, secret, listener_ports, peer_queues[r], results))
             for r in range(NP)]
    for process in ranks:
        process.start()
    try:
        ports = [listener_ports.get(timeout=60) for _ in range(NP)]
        strangers = make_noise([port for _, port in ports])
        for q in peer_queues:
            q.put(ports)
        reports = {}
        while len(reports) < NP:
            rank, message, at = results.get(timeout=60)
            reports[rank] = (message, at)
    finally:
        for stranger in strangers:
            stranger.close()
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    vanished_at = reports[VANISHING_RANK][1]
    for rank in set(range(NP)) - {VANISHING_RANK}:
        message, at = reports[rank]
        assert f"lost rank {VANISHING_RANK} on 127.0.0.1" in message, message
        assert at - vanished_at < 5.0
