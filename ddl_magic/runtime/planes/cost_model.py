"""The α-β-γ cost model of an allreduce over TCP, and the choice it makes between the ring
(`ring.py`) and recursive doubling (`recursive_doubling.py`).

A step that sends n bytes to a neighbour (and receives n from another at the same time)
costs α + nβ: α the latency of one message, Python's handling included, β the time per
byte on the link. Reducing n received bytes into one's own costs nγ (Thakur, Rabenseifner
and Gropp's model of MPICH's collectives, 2005). For a buffer of K bytes on N ranks:

    ring                2(N-1) steps of K/N:          2(N-1)α + 2K(N-1)/N·β
    recursive doubling  s = log2 P (+2 if N > P):     s·α + s·K·β + (s - fold out)·K·γ

The ring's reduction does not show: it reduces each received segment while the next one
arrives (`ring.py`). Recursive doubling reduces the whole buffer after each exchange. P is
the largest power of two not above N; when N > P the fold in and fold out are two more
steps of the whole buffer, the second with nothing to reduce. The ring wins for large K (it
moves each byte the fewest times), recursive doubling for small K (fewest steps), and
`prefers_recursive_doubling` picks the cheaper: the switch point is where the two lines
cross, which moves up with N (a 1024-rank ring has 2046 steps to pay for).

`NETWORK` and `LOCAL` hold α, β and γ fitted on the emulated network
(`benchmarks/emulated_network.py`: hosts in network namespaces, 0.2 ms and 1 Gbit/s on each
host's link, and ranks on one host over loopback, on a shared 2-core machine; README's "How
it scales" shows the fit and how well it predicts). A ring whose ranks all share one host
(TCP asked for on one host) uses `LOCAL`, any other `NETWORK`. Real clusters have other
latencies and bandwidths; the switch point follows their ratio α/β and N.
`DDL_MAGIC_ALLREDUCE_ALGORITHM` (auto, ring or recursive_doubling) overrides the choice on
every rank alike.

    >>> link = LinkCost(alpha_s=100e-6, beta_s_per_byte=1e-9, gamma_s_per_byte=0.5e-9)
    >>> round(ring_allreduce_s(4096, 8, link) * 1e3, 3), round(recursive_doubling_s(4096, 8, link) * 1e3, 3)
    (1.407, 0.318)
    >>> prefers_recursive_doubling(4096, 8, link), prefers_recursive_doubling(64 << 20, 8, link)
    (True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

from .recursive_doubling import rounds


@dataclass(frozen=True)
class LinkCost:
    alpha_s: float  # per message
    beta_s_per_byte: float  # per byte on the wire
    gamma_s_per_byte: float  # per byte reduced


# Fitted on the emulated network (see the module's docstring); the benchmark prints these
# lines for its own fit: paste them here to refit.
NETWORK = LinkCost(alpha_s=0.486e-3, beta_s_per_byte=7.92e-9, gamma_s_per_byte=0.377e-9)
LOCAL = LinkCost(alpha_s=0.33e-3, beta_s_per_byte=1.69e-9, gamma_s_per_byte=0.377e-9)


def link_between(hosts: int) -> LinkCost:
    """The link cost of a ring over `hosts` hosts: loopback on one, the network otherwise."""
    return LOCAL if hosts == 1 else NETWORK


def ring_allreduce_s(nbytes: int, size: int, link: LinkCost = NETWORK) -> float:
    """The model's time for the ring allreduce of `nbytes` on `size` ranks."""
    if size <= 1:
        return 0.0
    steps = 2 * (size - 1)
    return steps * link.alpha_s + steps * nbytes / size * link.beta_s_per_byte


def recursive_doubling_s(nbytes: int, size: int, link: LinkCost = NETWORK) -> float:
    """The model's time for recursive doubling of `nbytes` on `size` ranks."""
    steps = rounds(size)
    reductions = steps - (1 if size & (size - 1) else 0)  # the fold out reduces nothing
    return steps * (link.alpha_s + nbytes * link.beta_s_per_byte) + reductions * nbytes * link.gamma_s_per_byte


def prefers_recursive_doubling(nbytes: int, size: int, link: LinkCost = NETWORK) -> bool:
    """Is recursive doubling the cheaper allreduce of `nbytes` on `size` ranks?"""
    return size > 1 and recursive_doubling_s(nbytes, size, link) < ring_allreduce_s(nbytes, size, link)


def switch_bytes(size: int, link: LinkCost = NETWORK) -> int:
    """The largest buffer that recursive doubling takes on `size` ranks (0: never), found by
    bisection on the model (both costs are linear in the bytes).

    >>> switch_bytes(1), switch_bytes(2) > 0
    (0, True)
    """
    if not prefers_recursive_doubling(1, size, link):
        return 0
    low, high = 1, 1
    while prefers_recursive_doubling(high, size, link):
        high *= 2
        if high > 1 << 40:
            return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if prefers_recursive_doubling(middle, size, link) else (low, middle)
    return low


def allreduce_switch_bytes(algorithm: str, size: int, hosts: int) -> int:
    """The largest allreduce (in bytes) that recursive doubling runs on a ring of `size`
    ranks over `hosts` hosts under `DDL_MAGIC_ALLREDUCE_ALGORITHM` = `algorithm`; the ring
    runs the rest."""
    if algorithm == "ring" or size <= 1:
        return -1
    if algorithm == "recursive_doubling":
        return 1 << 62
    return switch_bytes(size, link_between(hosts))
