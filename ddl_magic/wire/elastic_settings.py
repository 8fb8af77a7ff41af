"""The settings an elastic run's driver and ranks must agree on, read from the environment
(the driver passes its values on to every rank, so both sides read the same numbers).

- `DDL_MAGIC_ELASTIC_TIMEOUT` (Horovod's `HOROVOD_ELASTIC_TIMEOUT` is read too): how long,
  in seconds, the driver waits for ranks when fewer than `min_np` are left before it fails
  the run. Default 60 s: Horovod's 600 s is long for a notebook cell, whose user sees the
  wait and can start the run again.
- `DDL_MAGIC_ELASTIC_RESET_LIMIT`: how many resets a run may have (default 10); the next
  failure ends it. Horovod's `--reset-limit` is unlimited by default: a bounded one means a
  failure that repeats at every attempt cannot restart forever.
- `DDL_MAGIC_ELASTIC_BLACKLIST_AFTER`: after that many lost ranks on a host (default 3), no
  replacement is started there.
"""

from __future__ import annotations

import os

ELASTIC_TIMEOUT_VARIABLE = "DDL_MAGIC_ELASTIC_TIMEOUT"
HOROVOD_ELASTIC_TIMEOUT_VARIABLE = "HOROVOD_ELASTIC_TIMEOUT"
DEFAULT_ELASTIC_TIMEOUT_S = 60.0
RESET_LIMIT_VARIABLE = "DDL_MAGIC_ELASTIC_RESET_LIMIT"
DEFAULT_RESET_LIMIT = 10
BLACKLIST_AFTER_VARIABLE = "DDL_MAGIC_ELASTIC_BLACKLIST_AFTER"
DEFAULT_BLACKLIST_AFTER = 3
# How long a replacement rank may take from its fork to its registration with the driver.
REPLACEMENT_START_S = 30.0


def elastic_timeout_s() -> float:
    """The wait for `min_np` ranks, in seconds (the module doc says where it comes from)."""
    name = (ELASTIC_TIMEOUT_VARIABLE if os.environ.get(ELASTIC_TIMEOUT_VARIABLE, "").strip()
            else HOROVOD_ELASTIC_TIMEOUT_VARIABLE)
    text = os.environ.get(name, "").strip()
    if not text:
        return DEFAULT_ELASTIC_TIMEOUT_S
    return _checked(name, text, float, 0, "a number of seconds", DEFAULT_ELASTIC_TIMEOUT_S)


def reset_limit() -> int:
    """How many resets a run may have (the module doc says where it comes from)."""
    text = os.environ.get(RESET_LIMIT_VARIABLE, str(DEFAULT_RESET_LIMIT))
    return _checked(RESET_LIMIT_VARIABLE, text, int, 0, "a whole number of resets",
                    DEFAULT_RESET_LIMIT)


def blacklist_after() -> int:
    """How many lost ranks on a host put it out of the run (the module doc says more)."""
    text = os.environ.get(BLACKLIST_AFTER_VARIABLE, str(DEFAULT_BLACKLIST_AFTER))
    return _checked(BLACKLIST_AFTER_VARIABLE, text, _digits, 1, "a number of failures",
                    DEFAULT_BLACKLIST_AFTER)


def _checked(name: str, text: str, parse, least: float, what: str, default: float):
    """`text`, the value of the variable `name`, read with `parse` and at least `least`; one
    that does not parse, or is lower, is refused with a message saying what to give."""
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise ValueError(f"{name}={text!r}: expected {what}, {least:g} or more (default {default:g})")
    return value


def _digits(text: str) -> int:
    if not text.isdigit():
        raise ValueError(text)
    return int(text)
