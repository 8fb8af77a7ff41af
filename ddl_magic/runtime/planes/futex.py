"""Sleeping on a word of shared memory until another process changes it (Linux futex).

A rank waiting for its neighbours on the same host spins on their progress counters for a
few microseconds, then sleeps here: `FUTEX_WAIT` puts the thread to sleep only if the word
still holds the value it last saw (checked atomically by the kernel, so a wake-up between
the check and the sleep cannot be lost), and `FUTEX_WAKE` wakes every sleeper. The word
lives in a mapping shared between processes, so the non-private futex operations are used.
A wait releases the GIL for its duration: other threads of the rank run on.
"""

from __future__ import annotations

import ctypes
import errno
import platform

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# Waking never blocks, so it keeps the GIL: a call through `CDLL` releases it, and the
# woken thread of this process would take it and make the waker wait to get it back.
_libc_holding_gil = ctypes.PyDLL(None)
_libc_holding_gil.syscall.restype = ctypes.c_long


def supported() -> bool:
    """Futexes (and the memory ordering the shared-memory transport relies on) are here."""
    return _SYS_FUTEX is not None


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at `address` equals `seen` (its low 32 bits), at most `timeout_s`.

    Returns early on a wake-up, a change of the word, a signal or the timeout alike: the
    caller re-reads the word and decides.
    """
    timeout = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    expected = ctypes.c_int32(seen & 0xFFFFFFFF)  # ctypes wraps: the kernel compares 32 bits
    result = _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, expected,
                           ctypes.byref(timeout), None, 0)
    if result == -1 and ctypes.get_errno() not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
        raise OSError(ctypes.get_errno(), "futex wait failed")


def wake_all(address: int) -> None:
    """Wake every thread sleeping in `wait` on the word at `address`, in any process."""
    _libc_holding_gil.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _WAKE_ALL,
                              None, None, 0)
