"""Allreduce on an emulated network: real rank processes on emulated hosts (network
namespaces, a delay and a rate on each host's link), ring against recursive doubling, and
the α-β-γ model (`runtime/planes/cost_model.py`) fitted to what was measured and checked
against it.

    sudo python benchmarks/emulated_network.py                 # ~3 min on 2 quiet cores
    sudo python benchmarks/emulated_network.py --delay-ms 0.2 --rate-mbit 1000 --repeats 1
    python benchmarks/emulated_network.py --refit benchmarks/results/emulated_network.json

Needs root (namespaces, TAP interfaces, tc: iproute2). Every host is a network namespace
with its own address on a TAP interface; the kernel's ``tbf`` shapes what the host sends to
the rate, and a switch (this script, `switch_main`) takes every frame from one host's TAP
interface and writes it into its destination's the delay later, as a switched network with
that latency would. (`tc netem` would do both in the kernel, but the kernel this was
written on is built without it; ``CONFIG_NET_SCH_NETEM`` is not set.) Ranks on one host
talk over that namespace's loopback. Hosts are named after their namespace, so the ranks'
rendezvous sees them as distinct hosts. The ranks run ddl_magic's runtime directly over a
fixed peer table (no driver), with ``DDL_MAGIC_TRANSPORT=tcp`` (the flat TCP ring) and
``DDL_MAGIC_ALLREDUCE_ALGORITHM`` set to each algorithm in turn.

Configurations: 1 host x 2 ranks (the local link), 2 hosts x 1, 4 hosts x 1, 2 hosts x 2,
4 hosts x 2.
Each measures a 4 KiB and a 64 MiB float32 allreduce (the slowest rank's time of each
repetition; the least disturbed repetition of every sweep is reported, as the other
benchmarks report theirs, and the median is saved too), a cached negotiation cycle (the
per-cycle time of the rank's own counters, `hvd.negotiation_counters()`) and a barrier (an
uncached cycle).

The model: an allreduce is its negotiation cycle (recursive doubling of the control vector)
and its data's steps, each step costing α + (bytes on the busiest host link) β + (bytes
reduced) γ, with the local link's α and β where a step stays within hosts: where two ranks
of a host send across at once they share its link, and recursive doubling's first round on
4 x 2 stays within the host; the ring reduces each segment while the next arrives, so its γ
is hidden. Two terms more are this machine's, not the network's: N ranks share 2 cores,
so each step also costs (κ + c·bytes sent)·N/cores, the CPU work of a rank's step paid over
by every rank queued on a core (on a cluster, a rank per core, they are part of α and β:
`as_cost_model`). The ring's steps are no barrier: a rank waits only for its left
neighbour, so its latency is that of a chunk's journey round the ring, one hop in every
ranks-per-host crossing hosts, while every step's bytes cross the host links (2 x 2 shows
this; on one-rank hosts every hop crosses). γ is measured here (a torch add); α, β, κ and c
are fitted on 1 x 2, 2 x 1, 4 x 1 and 2 x 2, and 4 x 2 is predicted from them; a second fit
on all five configurations says how well the model's form fits every cell. `--refit` does
the fitting and checking again from a saved run's JSON, without root.

Everything created is deleted on every exit path. The machine's load average is printed and
saved: other processes on 2 cores make every number noisier.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = [(1, 2), (2, 1), (4, 1), (2, 2), (4, 2)]  # (hosts, ranks per host)
ALGORITHMS = ("ring", "recursive_doubling")
SIZES = {"4KiB": 4096, "64MiB": 64 << 20}
PORT = 29611


# ---- on each rank ----------------------------------------------------------------------------

def rank_main(args: argparse.Namespace) -> None:
    """One rank: form the ring from the peer table, time the allreduces, print JSON."""
    import socket

    import torch

    from ddl_magic.runtime import context
    from ddl_magic.runtime.world import Peer

    torch.set_num_threads(1)
    peers = [Peer(rank, host, (address, PORT + rank)) for rank, (host, address) in
             enumerate(json.loads(args.peers))]
    me = peers[args.rank]
    listener = socket.create_server(me.address)
    os.environ.update(DDL_MAGIC_TRANSPORT="tcp", DDL_MAGIC_ALLREDUCE_ALGORITHM=args.algorithm)
    context.bootstrap = context.RankBootstrap(args.rank, peers, bytes.fromhex(os.environ["DDL_EMU_SECRET"]),
                                              listener)
    import ddl_magic.torch as hvd

    hvd.init()
    result: dict = {"rank": args.rank}
    for label, nbytes in SIZES.items():
        tensor = torch.ones(nbytes // 4)
        reps = args.reps if nbytes < 1 << 20 else args.large_reps
        for _ in range(2):
            hvd.allreduce_(tensor, op=hvd.Sum, name=f"warm.{label}")
        times = []
        for _ in range(reps):
            hvd.barrier()
            started = time.perf_counter()
            hvd.allreduce_(tensor, op=hvd.Sum, name=f"timed.{label}")
            times.append(time.perf_counter() - started)
        result[label] = times
    before = hvd.negotiation_counters()["cached"]
    tick = torch.ones(1)
    for _ in range(args.reps):
        hvd.allreduce_(tick, op=hvd.Sum, name="tick")
    after = hvd.negotiation_counters()
    cycles = after["cached"]["cycles"] - before["cycles"]
    seconds = (after["cached"]["seconds_per_cycle"] * after["cached"]["cycles"]
               - before["seconds_per_cycle"] * before["cycles"])
    result["cached_cycle_s"] = seconds / max(cycles, 1)
    result["cached_rounds"] = after["cached"]["rounds_per_cycle"]
    barriers = []
    for _ in range(args.reps):
        started = time.perf_counter()
        hvd.barrier()
        barriers.append(time.perf_counter() - started)
    result["barrier"] = barriers
    hvd.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # as a launched rank ends: no interpreter teardown racing torch's threads


# ---- the emulated hosts ------------------------------------------------------------------------

TUNSETIFF, IFF_TAP, IFF_NO_PI = 0x400454CA, 0x0002, 0x1000
TAP_MTU = 65000  # large frames: the switch then handles ~2000 of them per second at 1 Gbit/s


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def switch_main(args: argparse.Namespace) -> None:
    """The emulated network's switch: every host's TAP interface is a port; a frame that
    comes in on one goes out on its destination's port `delay` later (flooded where the
    destination is not known yet, as a learning switch does). The rate is the kernel's,
    each host's egress shaped by tbf before the frame reaches here."""
    import heapq
    import select

    try:  # a switch that waits its turn behind the ranks would add their load to the delay
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, AttributeError, OSError):
        pass
    ports = [int(fd) for fd in args.switch.split(",")]
    parent = int(args.parent_fd)
    for fd in ports:
        os.set_blocking(fd, False)
    delay = args.delay_ms / 1000
    port_of: dict[bytes, int] = {}
    pending: list = []
    order = 0
    while True:
        now = time.monotonic()
        timeout = max(0.0, pending[0][0] - now) if pending else 1.0
        readable, _, _ = select.select([*ports, parent], [], [], timeout)
        if parent in readable:
            return  # the benchmark ended (or died): its end of the pipe closed
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, TAP_MTU + 64)
                except BlockingIOError:
                    break
                source = ports.index(fd)
                port_of[frame[6:12]] = source
                known = port_of.get(frame[0:6])
                outs = [known] if known is not None else [p for p in range(len(ports)) if p != source]
                order += 1
                heapq.heappush(pending, (now + delay, order, outs, frame))
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, outs, frame = heapq.heappop(pending)
            for out in outs:
                try:
                    os.write(ports[out], frame)
                except (BlockingIOError, OSError):
                    pass  # a full queue drops the frame, as a switch does; TCP sends it again


class EmulatedHosts:
    """`count` network namespaces, each with a TAP interface whose frames go through a
    userspace switch that delays them (this machine's kernel has no netem: see README's "How
    it scales"), its egress rate shaped by the kernel's tbf."""

    def __init__(self, count: int, delay_ms: float, rate_mbit: float):
        tag = os.getpid() % 10000
        self.hosts = [f"emu{tag}h{index}" for index in range(count)]
        self.subnet = f"10.{200 + tag % 50}.{tag % 250}"
        self.delay_ms, self.rate_mbit = delay_ms, rate_mbit
        self._namespaces: list[str] = []
        self._taps: list[int] = []
        self._switch: subprocess.Popen | None = None
        self._parent_end: int | None = None

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index + 2}"

    def __enter__(self) -> "EmulatedHosts":
        import fcntl
        import struct

        try:
            for index, namespace in enumerate(self.hosts):
                tap = f"{namespace}t"
                _run("ip", "netns", "add", namespace)
                self._namespaces.append(namespace)
                _run("ip", "tuntap", "add", "dev", tap, "mode", "tap")
                fd = os.open("/dev/net/tun", os.O_RDWR)
                self._taps.append(fd)
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", tap.encode(), IFF_TAP | IFF_NO_PI))
                _run("ip", "link", "set", tap, "netns", namespace)  # the open fd stays attached
                inside = ("ip", "netns", "exec", namespace)
                _run(*inside, "ip", "link", "set", tap, "mtu", str(TAP_MTU))
                _run(*inside, "ip", "addr", "add", f"{self.address(index)}/24", "dev", tap)
                _run(*inside, "ip", "link", "set", tap, "up")
                _run(*inside, "ip", "link", "set", "lo", "up")
                _run(*inside, "tc", "qdisc", "add", "dev", tap, "root", "tbf", "rate",
                     f"{self.rate_mbit:g}mbit", "burst", "256kb", "latency", "100ms")
            switch_end, self._parent_end = os.pipe()
            self._switch = subprocess.Popen(
                [sys.executable, __file__, "--switch", ",".join(map(str, self._taps)),
                 "--parent-fd", str(switch_end), "--delay-ms", str(self.delay_ms)],
                pass_fds=(*self._taps, switch_end))
            os.close(switch_end)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        if self._parent_end is not None:
            os.close(self._parent_end)  # the switch sees its pipe close and ends
            self._parent_end = None
        if self._switch is not None:
            try:
                self._switch.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._switch.kill()
                self._switch.wait()
            self._switch = None
        for fd in self._taps:
            os.close(fd)
        self._taps.clear()
        for namespace in self._namespaces:  # takes its TAP interface with it
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
        self._namespaces.clear()


def run_config(hosts: EmulatedHosts, host_count: int, per_host: int, algorithm: str,
               reps: int, large_reps: int, timeout_s: float) -> list[dict]:
    """Start the ranks of one configuration in their namespaces; every rank's result."""
    placement = [(hosts.hosts[rank // per_host], hosts.address(rank // per_host))
                 for rank in range(host_count * per_host)]
    env = dict(os.environ, DDL_EMU_SECRET=secrets.token_hex(32), OMP_NUM_THREADS="1")
    processes = [subprocess.Popen(
        ["ip", "netns", "exec", namespace, sys.executable, __file__, "--rank", str(rank),
         "--peers", json.dumps(placement), "--algorithm", algorithm, "--reps", str(reps),
         "--large-reps", str(large_reps)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for rank, (namespace, _) in enumerate(placement)]
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout_s)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if process.returncode != 0 or not lines:
                raise RuntimeError(f"a rank failed ({process.returncode}): {err[-3000:]} OUT {out[-1500:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def slowest(results: list[dict], key: str) -> dict:
    """Each repetition's slowest rank's time (a collective is as slow as its slowest rank):
    the least disturbed repetition's, as `common.best_of` takes, and the median."""
    per_repetition = [max(times) for times in zip(*(result[key] for result in results))]
    return {"least_disturbed_s": min(per_repetition), "median_s": statistics.median(per_repetition)}


# ---- the model ---------------------------------------------------------------------------------

CONTROL_VECTOR_BYTES = 40  # a cached cycle's message: the bits of a few tensors, a flag, a header


def steps(algorithm: str, nbytes: int, host_count: int, per_host: int) -> list[tuple]:
    """The algorithm's steps on this placement, ranks placed host by host as the ring orders
    them: (its latency is the network's, its bytes go over the network, bytes on the
    busiest host link, bytes reduced, bytes each rank sends).

    Each step of the ring, every rank sends one chunk to its right neighbour (one flow per
    host link) and waits only for its left neighbour's: the bytes of every step cross the
    host links, but the latency on the critical path is a chunk's journey round the ring,
    of which one hop in `per_host` crosses to the next host. The ring reduces each segment
    while the next arrives: its reduction is hidden."""
    size = host_count * per_host
    if size == 1:
        return []
    networked = host_count > 1
    if algorithm == "ring":
        chunk = int(nbytes / size)
        hops = 2 * (size - 1)
        crossing = round(hops * host_count / size) if networked else 0
        return ([(True, networked, chunk, 0, chunk)] * crossing
                + [(False, networked, chunk, 0, chunk)] * (hops - crossing))
    largest = 1 << (size.bit_length() - 1)
    fold = size > largest
    result = [(networked, networked, nbytes, nbytes, nbytes)] if fold else []
    distance = 1
    while distance < largest:
        crosses = distance >= per_host
        # between hosts, every rank of a host sends its whole buffer across its host's link
        result.append((crosses, crosses, nbytes * (per_host if crosses else 1), nbytes, nbytes))
        distance <<= 1
    return result + ([(networked, networked, nbytes, 0, nbytes)] if fold else [])


def _terms(algorithm: str, nbytes: int, host_count: int, per_host: int, cores: int) -> list[float]:
    """The model's coefficients of (α local, α network, κ, β local, β network, c) and its γ
    part, for one allreduce: its negotiation cycle (recursive doubling of the control
    vector) and its data, every step costing α + κ·load + (link bytes)·β + (bytes the rank
    sends)·c·load + (bytes reduced)·γ, where load = ranks / cores."""
    load = host_count * per_host / cores
    terms = [0.0] * 7
    for latency_crosses, bytes_cross, link_bytes, reduced, sent in (
            steps("recursive_doubling", CONTROL_VECTOR_BYTES, host_count, per_host)
            + steps(algorithm, nbytes, host_count, per_host)):
        terms[1 if latency_crosses else 0] += 1
        terms[2] += load
        terms[4 if bytes_cross else 3] += link_bytes
        terms[5] += sent * load
        terms[6] += reduced
    return terms


_RUN_KEYS = ("delay_ms", "rate_mbit", "reps", "large_reps", "repeats", "cores", "load_average",
             "measured", "sweeps", "gamma_s_per_byte")
_UNKNOWNS = ("alpha_local_s", "alpha_network_s", "kappa_s", "beta_local_s_per_byte",
             "beta_network_s_per_byte", "cpu_s_per_byte")


def model_s(algorithm: str, nbytes: int, host_count: int, per_host: int, fitted: dict,
            cores: int) -> float:
    *terms, reduced = _terms(algorithm, nbytes, host_count, per_host, cores)
    return (sum(term * fitted[name] for term, name in zip(terms, _UNKNOWNS))
            + reduced * fitted["gamma_s_per_byte"])


def fit(points: list[tuple[str, int, int, int, float]], gamma: float, cores: int) -> dict:
    """Least squares, each point's relative error weighted alike (a 4 KiB point counts as
    much as a 64 MiB one), none negative: α local and network, κ and c (what one rank's
    step costs the CPU, per step and per byte it sends, paid N/cores times over when N
    ranks share the cores), β local and network."""
    import numpy

    rows, targets = [], []
    for algorithm, nbytes, host_count, per_host, measured in points:
        *unknown, reduced = _terms(algorithm, nbytes, host_count, per_host, cores)
        rows.append([term / measured for term in unknown])
        targets.append(1.0 - reduced * gamma / measured)
    matrix, target = numpy.array(rows), numpy.array(targets)
    kept = list(range(matrix.shape[1]))
    while True:  # no negative latency, bandwidth or CPU cost: drop the most negative, refit
        kept_solution, *_ = numpy.linalg.lstsq(matrix[:, kept], target, rcond=None)
        if (kept_solution >= 0).all():
            break
        kept.pop(int(numpy.argmin(kept_solution)))
    solution = numpy.zeros(matrix.shape[1])
    solution[kept] = kept_solution
    return dict(zip(_UNKNOWNS, map(float, solution))) | {"gamma_s_per_byte": gamma}


def as_cost_model(fitted: dict, link: str) -> dict:
    """α, β and γ for `cost_model.LinkCost` on a cluster, where each rank has a core: the
    CPU terms at a load of one rank per core."""
    return {"alpha_s": fitted[f"alpha_{link}_s"] + fitted["kappa_s"],
            "beta_s_per_byte": fitted[f"beta_{link}_s_per_byte"] + fitted["cpu_s_per_byte"],
            "gamma_s_per_byte": fitted["gamma_s_per_byte"]}


def measure_gamma() -> float:
    """Seconds per byte of a float32 add (the reduction), on this machine."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.ones(16 << 20), torch.ones(16 << 20)
    times = []
    for _ in range(7):
        started = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - started)
    return min(times) / (64 << 20)  # the least disturbed: other processes share the cores


# ---- the driver ---------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=0.2)
    parser.add_argument("--rate-mbit", type=float, default=1000.0)
    parser.add_argument("--reps", type=int, default=30, help="repetitions of 4 KiB (default 30)")
    parser.add_argument("--large-reps", type=int, default=2,
                        help="repetitions of 64 MiB (default 2)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="sweeps over every configuration; the least disturbed is reported "
                             "(default 3)")
    parser.add_argument("--refit", metavar="JSON",
                        help="fit and check the model again on a saved run's measurements "
                             "(benchmarks/results/emulated_network.json): no root, seconds")
    parser.add_argument("--switch", help=argparse.SUPPRESS)
    parser.add_argument("--parent-fd", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--peers", help=argparse.SUPPRESS)
    parser.add_argument("--algorithm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.switch is not None:
        switch_main(args)
        return
    if args.rank is not None:
        rank_main(args)
        return
    if args.refit:
        with open(args.refit, encoding="utf-8") as saved:
            run = json.load(saved)
        run["gamma_s_per_byte"] = run["fit"]["gamma_s_per_byte"]  # measured, not fitted
        report({key: value for key, value in run.items() if key in _RUN_KEYS})
        return
    if os.geteuid() != 0:
        sys.exit("the emulated network needs root (network namespaces, veth pairs, tc)")
    load_before = os.getloadavg()[0]
    print(f"load average {load_before:.1f} on {os.cpu_count()} CPUs at the start")
    cores = os.cpu_count() or 1
    gamma = measure_gamma()
    runs: dict = {}
    started = time.perf_counter()
    with EmulatedHosts(max(h for h, _ in CONFIGS), args.delay_ms, args.rate_mbit) as hosts:
        for repeat in range(args.repeats):  # the whole sweep again: load that comes and goes
            for host_count, per_host in CONFIGS:  # hits every configuration alike
                for algorithm in ALGORITHMS:
                    results = run_config(hosts, host_count, per_host, algorithm, args.reps,
                                         args.large_reps, timeout_s=600)
                    key = f"{host_count}x{per_host}"
                    timed = {label: slowest(results, label) for label in SIZES}
                    runs.setdefault(key, {}).setdefault(algorithm, []).append({
                        **{label: timed[label]["least_disturbed_s"] for label in SIZES},
                        **{f"{label}_median": timed[label]["median_s"] for label in SIZES},
                        "cached_cycle_s": statistics.median(r["cached_cycle_s"] for r in results),
                        "cached_rounds": results[0]["cached_rounds"],
                        "barrier_s": slowest(results, "barrier")["least_disturbed_s"]})
                    print(f"{key} {algorithm} (sweep {repeat + 1}): " + ", ".join(
                        f"{label} {runs[key][algorithm][-1][label] * 1e3:.2f} ms"
                        for label in SIZES), flush=True)
    load_after = os.getloadavg()[0]
    measured = {key: {algorithm: {name: min(run[name] for run in repeats)
                                  for name in repeats[0]}
                      for algorithm, repeats in by_algorithm.items()}
                for key, by_algorithm in runs.items()}
    print(f"load average {load_before:.1f} -> {load_after:.1f}; "
          f"{time.perf_counter() - started:.0f} s")
    report({"delay_ms": args.delay_ms, "rate_mbit": args.rate_mbit, "reps": args.reps,
            "large_reps": args.large_reps, "repeats": args.repeats, "cores": cores,
            "load_average": [load_before, load_after], "measured": measured, "sweeps": runs,
            "gamma_s_per_byte": gamma})


def checks_of(measured: dict, fitted: dict, cores: int, held_out: list[tuple[int, int]]) -> list[dict]:
    """The model against every measured cell: its error, and whether the cell was predicted
    (its configuration held out of the fit) or fitted."""
    checks = []
    for host_count, per_host in _measured_configs(measured):
        key = f"{host_count}x{per_host}"
        for algorithm in ALGORITHMS:
            for label, nbytes in SIZES.items():
                actual = measured[key][algorithm][label]
                predicted = model_s(algorithm, nbytes, host_count, per_host, fitted, cores)
                checks.append({"config": key, "algorithm": algorithm, "size": label,
                               "measured_s": actual, "model_s": predicted,
                               "error": predicted / actual - 1,
                               "predicted_not_fitted": (host_count, per_host) in held_out})
    return checks


def _measured_configs(measured: dict) -> list[tuple[int, int]]:
    return [(h, p) for h, p in CONFIGS if f"{h}x{p}" in measured]


def report(run: dict) -> None:
    """Fit the model to a run's measurements, print the tables, write the JSON. Two checks:
    fitted on every configuration but 4 x 2, predicting 4 x 2 (held out); and fitted on all."""
    sys.path.insert(0, str(Path(__file__).parent))
    from common import print_table, write_results

    measured, cores, gamma = run["measured"], run["cores"], run["gamma_s_per_byte"]

    def points(configs):
        return [(algorithm, nbytes, h, p, measured[f"{h}x{p}"][algorithm][label])
                for h, p in configs for algorithm in ALGORITHMS for label, nbytes in SIZES.items()]

    configs = _measured_configs(measured)  # a run saved before 2 x 2 was measured lacks it
    held_out = [(4, 2)]
    fitted = fit(points([c for c in configs if c not in held_out]), gamma, cores)
    checks = checks_of(measured, fitted, cores, held_out)
    fitted_on_all = fit(points(configs), gamma, cores)
    checks_on_all = checks_of(measured, fitted_on_all, cores, [])
    rows = [[c["config"], c["algorithm"], c["size"], f"{c['measured_s'] * 1e3:.2f}",
             f"{c['model_s'] * 1e3:.2f}",
             f"{c['error'] * 100:+.0f} %" + (" (predicted)" if c["predicted_not_fitted"] else ""),
             f"{a['model_s'] * 1e3:.2f}", f"{a['error'] * 100:+.0f} %"]
            for c, a in zip(checks, checks_on_all)]
    print_table(f"allreduce, ms ({run['delay_ms']} ms delay, {run['rate_mbit']:g} Mbit/s per host "
                f"link; least disturbed of {run['repeats']} sweeps)",
                ["hosts x ranks", "algorithm", "size", "measured", "model", "model error",
                 "model (fit on all)", "error"], rows)
    ratio = measured["4x2"]["recursive_doubling"]["4KiB"] / measured["4x2"]["ring"]["4KiB"]
    rows = [[key, f"{m['ring']['cached_cycle_s'] * 1e3:.2f}", f"{m['ring']['cached_rounds']:.1f}",
             f"{m['ring']['barrier_s'] * 1e3:.2f}"] for key, m in measured.items()]
    print_table("negotiation: a cached cycle (rank-local mean) and a barrier (an uncached cycle), ms",
                ["hosts x ranks", "cached cycle", "rounds", "barrier"], rows)
    print(f"\nfitted: network α {fitted['alpha_network_s'] * 1e3:.3f} ms, β "
          f"{fitted['beta_network_s_per_byte'] * 1e9:.2f} ns/B; local α "
          f"{fitted['alpha_local_s'] * 1e3:.3f} ms, β {fitted['beta_local_s_per_byte'] * 1e9:.2f} ns/B;"
          f" per rank and core: κ {fitted['kappa_s'] * 1e3:.3f} ms per step, c "
          f"{fitted['cpu_s_per_byte'] * 1e9:.2f} ns/B sent; γ {gamma * 1e9:.2f} ns/B (measured)")
    for link in ("network", "local"):
        print(f"cost_model.{link.upper()} = LinkCost(" + ", ".join(
            f"{name}={value:.3g}" for name, value in as_cost_model(fitted, link).items()) + ")")
    print(f"4 KiB on 4 hosts x 2 ranks: recursive doubling / ring = {ratio:.2f} (target 0.6)")
    worst = max(abs(check["error"]) for check in checks)
    worst_on_all = max(abs(check["error"]) for check in checks_on_all)
    print(f"largest model error (target 25 %): {worst * 100:.0f} % fitted on {len(configs) - 1} configurations "
          f"and predicting 4 x 2, {worst_on_all * 100:.0f} % fitted on all {len(configs)}")
    path = write_results("emulated_network", {
        **{key: value for key, value in run.items() if key != "gamma_s_per_byte"},
        "fit": fitted, "cost_model": {link: as_cost_model(fitted, link) for link in ("network", "local")},
        "checks": checks, "recursive_doubling_over_ring_4KiB_4x2": ratio,
        "largest_model_error": worst, "fit_on_all": fitted_on_all, "checks_fit_on_all": checks_on_all,
        "largest_model_error_fit_on_all": worst_on_all})
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
