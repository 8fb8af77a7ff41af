"""The settings an elastic run's driver and ranks must agree on, read from the environment
(the driver passes its values on to every rank, so both sides read the same numbers).

- `DDL_MAGIC_ELASTIC_TIMEOUT` (Horovod's `HOROVOD_ELASTIC_TIMEOUT` is read too): how long,
  in seconds, the driver waits for ranks when fewer than `min_np` are left before it fails
  the run. Default 60 s: Horovod's 600 s is long for a notebook cell, whose user sees the
  wait and can start the run again.
- `DDL_MAGIC_ELASTIC_RESET_LIMIT`: how many resets a run may have (default 10); the next
  failure ends it. Horovod's `--reset-limit` is unlimited by default: a bounded one means a
  failure that repeats at every attempt cannot restart forever.
"""

from __future__ import annotations

import os

ELASTIC_TIMEOUT_VARIABLE = "DDL_MAGIC_ELASTIC_TIMEOUT"
HOROVOD_ELASTIC_TIMEOUT_VARIABLE = "HOROVOD_ELASTIC_TIMEOUT"
DEFAULT_ELASTIC_TIMEOUT_S = 60.0
RESET_LIMIT_VARIABLE = "DDL_MAGIC_ELASTIC_RESET_LIMIT"
DEFAULT_RESET_LIMIT = 10
# How long a replacement rank may take from its fork to its registration with the driver.
REPLACEMENT_START_S = 30.0


def elastic_timeout_s() -> float:
    """The wait for `min_np` ranks, in seconds (the module doc says where it comes from)."""
    name = (ELASTIC_TIMEOUT_VARIABLE if os.environ.get(ELASTIC_TIMEOUT_VARIABLE, "").strip()
            else HOROVOD_ELASTIC_TIMEOUT_VARIABLE)
    text = os.environ.get(name, "").strip()
    if not text:
        return DEFAULT_ELASTIC_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise ValueError(f"{name}={text!r}: expected a number of seconds, 0 or more "
                         f"(default {DEFAULT_ELASTIC_TIMEOUT_S:g})")
    return seconds


def reset_limit() -> int:
    """How many resets a run may have (the module doc says where it comes from)."""
    text = os.environ.get(RESET_LIMIT_VARIABLE, str(DEFAULT_RESET_LIMIT))
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ValueError(f"{RESET_LIMIT_VARIABLE}={text!r}: expected a whole number of "
                         f"resets, 0 or more (default {DEFAULT_RESET_LIMIT})")
    return limit
