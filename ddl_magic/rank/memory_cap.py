"""A memory cap per rank, and how a rank that ran out of memory is named.

    %%horovod -np 4 --memory-per-rank 1GiB      # each rank may hold 1 GiB, as on a smaller machine

With a cap, each local rank runs in a memory cgroup of its own (cgroup v1's memory controller,
which needs root), limited to the cap: a rank that goes over it is killed by the kernel's OOM
killer, as a rank of a real cluster whose machine has that much memory would be. The cap
travels as `DDL_MAGIC_MEMORY_PER_RANK` (bytes) in the run's environment; the rank enters its
cgroup as soon as it has it, before anything of the user's runs, and the rank factory, which
reaps it, reads what happened and removes the cgroup.

With or without a cap, a rank killed by SIGKILL is named as out of memory when the kernel's
OOM killer killed it: its cgroup counted an OOM kill, or, uncapped, the kernel's log names its
pid. Where the log cannot be read (not root, or a pid namespace whose pids the log does not
use) and the machine's OOM-kill count (`/proc/vmstat`) went up while it ran, it is named as
killed by SIGKILL, probably out of memory: the machine's count is any process's, and a rank
killed by a person or a supervisor must not read as out of memory. Its peak resident memory
(the factory's `wait4`) comes with the name. Where no cgroup can be made (not Linux, no v1 memory
controller, not root), `unavailable()` says why, and the run is refused before it starts.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal

from . import allocator

VARIABLE = "DDL_MAGIC_MEMORY_PER_RANK"
CONTROLLER = "/sys/fs/cgroup/memory"
_KILLED_BY_THE_OOM_KILLER = re.compile(rb"out of memory: Killed process (\d+) ")
SYSLOG_ACTION_READ_ALL, SYSLOG_ACTION_SIZE_BUFFER = 3, 10  # klogctl(2)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; '1.5G' and '512MiB' too; a plain number is bytes.

    >>> parse_size("1GiB"), parse_size("512MB"), parse_size("1.5g")
    (1073741824, 512000000, 1610612736)
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"--memory-per-rank {text!r} is not a size: write it as 2GiB, 1.5G, "
                         "512MiB or a number of bytes")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    base = 1024 if binary or (unit and not text.strip().upper().endswith("B")) else 1000
    size = int(number * base ** " KMGT".index(unit or " "))
    if size < 64 << 20:
        raise ValueError(f"--memory-per-rank {text!r} is less than 64 MiB, which a rank with torch "
                         "imported exceeds before any of your code runs")
    return size


def format_size(size: float) -> str:
    """1610612736 -> '1.50 GiB'."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if size >= factor:
            return f"{size / factor:.2f} {unit}"
    return f"{size / 1024:.0f} KiB"


def unavailable() -> str | None:
    """Why a rank cannot be capped on this machine, or None where it can."""
    if not os.path.isfile(os.path.join(CONTROLLER, "memory.limit_in_bytes")):
        return (f"there is no cgroup v1 memory controller at {CONTROLLER} (a Linux machine with "
                "cgroup v1, as these are, is needed)")
    if not os.access(CONTROLLER, os.W_OK):
        return f"only root may create memory cgroups under {CONTROLLER}, and this is uid {os.getuid()}"
    return None


def capped_environment(size: str, on_spark: bool) -> dict[str, str]:
    """The variable that caps every local rank at `size` (`--memory-per-rank`), checked here,
    before anything starts.

    >>> capped_environment("1GiB", on_spark=True)
    Traceback (most recent call last):
    ValueError: --memory-per-rank caps local ranks; on Spark a rank has its executor's memory (spark.executor.memory and the cluster's machines): run with --local to rehearse a cap
    """
    limit = parse_size(size)
    if on_spark:
        raise ValueError("--memory-per-rank caps local ranks; on Spark a rank has its executor's "
                         "memory (spark.executor.memory and the cluster's machines): run with "
                         "--local to rehearse a cap")
    why = unavailable()
    if why is not None:
        raise ValueError(f"--memory-per-rank needs a memory cgroup for each rank, and {why}")
    return {VARIABLE: str(limit)}


def cgroup_of(pid: int) -> str:
    """A rank's cgroup, by its pid, at the controller's root (no parent to leave behind)."""
    return os.path.join(CONTROLLER, f"ddl_magic-rank-{pid}")


def is_capped(pid: int) -> bool:
    """Is the rank `pid` in a memory cgroup of its own (`--memory-per-rank`)?"""
    return os.path.isdir(cgroup_of(pid))


def cap_this_process(limit: int) -> None:
    """Put this process (a freshly forked rank) in a memory cgroup of its own, limited to
    `limit` bytes. Its children go with it.

    It also returns what it frees to the kernel: glibc serves a large allocation with mmap
    only up to a threshold that grows to the largest block freed so far, and from its heap
    above that, where freed memory mostly stays with the process. FSDP2 allocates and frees
    a whole layer's parameters and gradients every step: freed, they would still count
    against the cap (a rank's memory then grows by hundreds of MB over a few steps, over gloo
    as over ddl). A fixed threshold keeps every block over 1 MiB in mmap, returned when freed.
    """
    path = cgroup_of(os.getpid())
    os.mkdir(path)
    _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
    _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    allocator.return_large_blocks_when_freed()


def machine_oom_kills() -> int:
    """How many processes the kernel's OOM killer has killed since boot."""
    try:
        with open("/proc/vmstat") as vmstat:
            for line in vmstat:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def out_of_memory(pid: int, returncode: int, peak_rss: int, oom_kills_before: int) -> str:
    """Why the rank `pid`, just reaped, died, where it ran out of memory ("" otherwise), and
    its cgroup removed. `peak_rss`: its peak resident bytes; `oom_kills_before`: the
    machine's count when it started."""
    path = cgroup_of(pid)
    capped = is_capped(pid)
    limit = oom_kills = charged = 0
    if capped:
        limit = int(_read(os.path.join(path, "memory.limit_in_bytes")) or 0)
        charged = int(_read(os.path.join(path, "memory.max_usage_in_bytes")) or 0)
        found = re.search(r"^oom_kill (\d+)$", _read(os.path.join(path, "memory.oom_control")), re.M)
        oom_kills = int(found.group(1)) if found else 0
        try:
            os.rmdir(path)
        except OSError:
            pass  # a process the rank started outlives it in there: its cgroup stays with it
    if returncode != -signal.SIGKILL:
        return ""
    peak = f"; its peak resident memory was {format_size(peak_rss)}"
    if capped and oom_kills:
        return (f"out of memory: killed by the kernel's OOM killer at its memory cap of "
                f"{format_size(limit)} (--memory-per-rank){peak}, of which "
                f"{format_size(charged)} counted against the cap (the rest is torch's memory, "
                "shared with the process the rank was forked from)")
    if capped or machine_oom_kills() == oom_kills_before:  # (no OOM kill at all: at once)
        return ""
    named_in_the_log = killed_by_the_oom_killer(pid)
    if named_in_the_log:
        return f"out of memory: killed by the kernel's OOM killer, the machine being out of memory{peak}"
    if named_in_the_log is None:
        return ("killed by SIGKILL while the kernel's OOM killer was killing processes on this "
                f"machine: probably out of memory{peak}")
    return ""


def killed_by_the_oom_killer(pid: int) -> bool | None:
    """Whether the kernel's log says its OOM killer killed `pid`; None where this process
    cannot tell: the log is not readable here (`klogctl` needs root or CAP_SYSLOG), or this
    process is in a pid namespace (the log names pids as the kernel's first namespace
    numbers them). One call reads the whole log (as `dmesg` does)."""
    if len(_read("/proc/self/status").partition("NSpid:")[2].split("\n")[0].split()) > 1:
        return None
    try:
        klogctl = ctypes.CDLL(None, use_errno=True).klogctl
    except (OSError, AttributeError):  # not Linux's C library
        return None
    size = klogctl(SYSLOG_ACTION_SIZE_BUFFER, None, 0)
    log = ctypes.create_string_buffer(max(size, 0))
    length = klogctl(SYSLOG_ACTION_READ_ALL, log, size) if size > 0 else -1
    if length < 0:
        return None
    return pid in {int(victim) for victim in _KILLED_BY_THE_OOM_KILLER.findall(log.raw[:length])}


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
