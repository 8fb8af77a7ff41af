"""What a pool says and decides about its lost ranks: pure, tested without processes.

Why a lost rank breaks a plain pool instead of restarting it behind the user's back: a
rank's namespace holds what earlier cells built (a model half trained); fresh ranks would
run the next cell without it and fail further on, or worse, succeed on a different state.
The user decides, with one command (`%horovod restart`). Or, starting the pool with
`min_np`, decides up front that lost ranks are replaced while `min_np` are left (the cells
rebuild what a replacement lacks, e.g. by broadcasting rank 0's model); each replacement
starts empty, and the user is told which rank did and what it lost (`replaced_message`).
"""

from __future__ import annotations

from .events import describe_ranks


def describe_lost(gone: dict[int, str], hosts: list[str], when: str) -> str:
    """'ranks 1 and 3 (host-b) were lost (host-b stopped answering ...) while the pool was
    idle': the lost ranks by host, each host's with its first rank's reason.

    >>> describe_lost({1: "killed by SIGKILL"}, ["a", "a"], "in cell 2")
    'rank 1 (a) was lost (killed by SIGKILL) in cell 2'
    """
    by_host: dict[str, list[int]] = {}
    for rank in sorted(gone):
        by_host.setdefault(hosts[rank], []).append(rank)
    return "; ".join(
        f"{describe_ranks(ranks)}{f' ({host})' if host else ''} "
        f"{'was' if len(ranks) == 1 else 'were'} lost ({gone[ranks[0]]}) {when}"
        for host, ranks in by_host.items())


def why_not_replaced(np: int, lost: int, min_np: int | None) -> str | None:
    """Why the pool breaks instead of replacing `lost` ranks, or None: it replaces them.

    >>> why_not_replaced(4, 1, None), why_not_replaced(4, 3, 2), why_not_replaced(4, 2, 2)
    ('', '1 rank left, fewer than min_np=2', None)
    """
    if min_np is None:
        return ""  # not elastic: what was lost says it all
    left = np - lost
    if left < min_np:
        return f"{left} rank{'s' if left != 1 else ''} left, fewer than min_np={min_np}"
    return None


def replaced_message(what: str, lost: list[int], rank_names: set[str]) -> str:
    """What the user is told once fresh ranks replaced `lost`: which start empty, and which
    names earlier cells had assigned there."""
    fresh = "a fresh rank, which starts" if len(lost) == 1 else "fresh ranks, which start"
    names = f" ({', '.join(sorted(rank_names))})" if rank_names else ""
    return (f"{what}; {describe_ranks(lost)} replaced by {fresh} empty: what earlier cells "
            f"assigned there{names} is gone; the other ranks keep theirs")
