"""Deciding, across ranks, which collectives run next and in what order (Horovod's model).

Ranks submit collectives in whatever order their code reaches them. Before data moves, all
ranks must agree on *which* tensors to process and in *which* order, or the ring would pair
rank 0's gradient A with rank 1's gradient B. Rank 0 coordinates:

1. every rank sends rank 0 the requests it has submitted (name, kind, dtype, shape, op);
2. rank 0 collects them per name; a name is ready once every rank has submitted it, and its
   requests are checked to agree (a mismatch becomes an error response naming the ranks);
3. rank 0 answers every rank with the same list of responses, fusing ready allreduces of the
   same dtype and op into one response up to the fusion threshold;
4. every rank executes the responses in that order.

A rank that has run out of data calls `join()`: from then on it counts as having submitted
every allreduce, and takes part with zeros, until every rank has joined.

Steady state is cheap: once a name has been negotiated, rank 0 gives its request a cache id
and ranks resubmit an unchanged request as that small integer. Ranks in lockstep go one step
further (`Coordinator.agree`, Horovod's response cache): when every rank announces the same
list of cache ids and nothing else is outstanding, the answer is the one worked out the first
time that list came, taken from a memo instead of recomputed request by request.

Rank 0 waits up to the cycle time after the first ready tensor so that more can join the
same fused buffer, except when some rank is already blocked waiting for a ready tensor: then
waiting would only add latency.

A name that some ranks submitted and others have not is reported as a stall after
`stall_time_s` (Horovod's stall check), and once it has waited `timeout_s`
(`DDL_MAGIC_TIMEOUT`) it has `expired`: the op queue then fails the collective on the ranks
that wait for it, naming the ranks that never came (the stall report always comes first).

The `Coordinator` is pure logic. Over TCP it runs on rank 0 alone, for what the ranks'
response caches cannot settle by themselves (`lockstep.py`: in a training loop's steady state
a bitwise allreduce of the cache decides, and rank 0 hears nothing more); when every rank
shares one host, every rank runs a replica of it, fed the same requests in the same order,
and each takes its decisions itself (`op_queue_shm.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

CACHE_CAPACITY = 1024  # requests remembered for cheap resubmission, as Horovod's default
PLAN_CAPACITY = 256  # lockstep answers remembered by `Coordinator.agree`


class Request(NamedTuple):
    """One rank's description of one named collective.

    A named tuple, not a dataclass: a training step creates, hashes and compares these by
    the thousand, and a tuple does all three in C.
    """

    name: str
    kind: str  # "allreduce", "reducescatter", "allgather", "broadcast", "barrier" or "join"
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: int = 0
    root: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    splits: tuple[int, ...] = ()  # reducescatter: how many rows of dimension 0 each rank keeps
    device: str = "cpu"  # where the tensor lives: "cpu" or "cuda" (GPU memory moves otherwise)

    @classmethod
    def of(cls, name: str, kind: str, tensor: torch.Tensor | None, op: int = 0, root: int = 0,
           prescale: float = 1.0, postscale: float = 1.0, splits: tuple[int, ...] = ()) -> "Request":
        """The request for a collective of `tensor` (None for a barrier or a join).

        (Built from positional arguments: a named tuple takes keywords at twice the cost.)
        """
        if tensor is None:
            return cls(name, kind, torch.uint8, (), op, root, prescale, postscale, splits)
        return cls(name, kind, tensor.dtype, tuple(tensor.shape), op, root, prescale, postscale,
                   splits, "cpu" if tensor.is_cpu else tensor.device.type)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        text = f"{self.kind} {dtype}{list(self.shape)}"
        if self.device != "cpu":
            text += f" on {self.device}"
        if self.kind in ("allreduce", "reducescatter"):
            text += f" op={self.op} prescale={self.prescale} postscale={self.postscale}"
        if self.kind == "reducescatter":
            text += f" splits={list(self.splits)}"
        if self.kind == "broadcast":
            text += f" root={self.root}"
        return text

    def agrees_with(self, other: "Request") -> bool:
        """Can these two ranks' requests run as one collective?"""
        if (self.kind, self.dtype, self.device) != (other.kind, other.dtype, other.device):
            return False
        if self.kind == "allgather":  # ranks may contribute different first dimensions
            return self.shape[1:] == other.shape[1:] and len(self.shape) == len(other.shape)
        if self.kind == "broadcast":
            return (self.shape, self.root) == (other.shape, other.root)
        if self.kind in ("allreduce", "reducescatter"):
            return (self.shape, self.op, self.prescale, self.postscale, self.splits) == (
                other.shape, other.op, other.prescale, other.postscale, other.splits)
        return True


class Response(NamedTuple):
    """What every rank executes next: one collective over `names` (several when fused)."""

    kind: str
    names: tuple[str, ...]
    error: str | None = None
    first_dims: tuple[int, ...] = ()  # allgather: each rank's first dimension, in rank order
    # Ranks that have called join() contribute zeros; these requests tell them the shapes.
    for_joined_ranks: tuple[Request, ...] = ()
    last_joined_rank: int = -1  # join: the rank that joined last


@dataclass
class Cycle:
    """Rank 0's answer to all ranks: the responses, and new cache ids for their requests."""

    responses: list[Response]
    cache_updates: dict[int, Request] = field(default_factory=dict)


class RequestCache:
    """A rank's side of the response cache: resubmits a known request as its id."""

    def __init__(self):
        self._by_name: dict[str, tuple[int, Request]] = {}

    def encode(self, request: Request) -> "Request | int":
        cached = self._by_name.get(request.name)
        return cached[0] if cached is not None and cached[1] == request else request

    def update(self, updates: dict[int, Request]) -> None:
        for cache_id, request in updates.items():
            self._by_name[request.name] = (cache_id, request)


class Coordinator:
    """Rank 0's bookkeeping: who submitted what, what is ready, and what to run next."""

    def __init__(self, run_ranks: tuple[int, ...], fusion_threshold: int, cycle_time_s: float,
                 stall_time_s: float, timeout_s: float = math.inf):
        self.size = len(run_ranks)
        # Ranks are counted 0..size-1 within the ring; messages name them by their rank in the
        # run (they differ in a process set's ring).
        self._run_ranks = run_ranks
        self.fusion_threshold = fusion_threshold
        self.cycle_time_s = cycle_time_s
        self.stall_time_s = stall_time_s
        self.timeout_s = timeout_s
        self._submitted: dict[str, dict[int, Request]] = {}
        # Names some ranks submitted and others not yet, oldest first, until warned about.
        self._waiting_since: dict[str, float] = {}
        # The same, until they are ready (or expire): what `expired` judges.
        self._partial_since: dict[str, float] = {}
        self._ready: dict[str, None] = {}  # names ready on every rank, in the order they became so
        self._ready_since: float | None = None
        self._waited: set[str] = set()
        self._cache: dict[int, Request] = {}
        self._cache_id_of: dict[Request, int] = {}
        self._joined: list[int] = []  # in the order ranks called join()
        # Lockstep answers by the list of cache ids every rank announced (see `agree`).
        self._plans: dict[tuple[int, ...], tuple[Response, ...]] = {}

    def agree(self, announcements: list[list["Request | int"]], now: float) -> Cycle | None:
        """Lockstep negotiation: every rank's announcements of one cycle, in rank order; the
        responses to run now (everything ready), or None.

        A training loop announces the same cached requests on every rank, step after step,
        with nothing else outstanding. Such a cycle depends on nothing but that list of cache
        ids, so its answer is worked out once, by `submit` and `take_cycle`, and reused.
        """
        first = announcements[0]
        steady = (first and not self._submitted and not self._joined
                  and all(type(item) is int for item in first)
                  and all(other == first for other in announcements[1:]))
        if steady:
            plan = self._plans.get(key := tuple(first))
            if plan is not None:
                return Cycle(list(plan))
        for rank, requests in enumerate(announcements):
            self.submit(rank, requests, now)
        cycle = self.take_cycle(now, flush=True)
        if (steady and cycle is not None and not self._submitted and not cycle.cache_updates
                and all(response.error is None for response in cycle.responses)):
            if len(self._plans) >= PLAN_CAPACITY:
                self._plans.clear()  # a program that keeps changing its steps: start afresh
            self._plans[key] = tuple(cycle.responses)
        return cycle

    def name_of(self, item: "Request | int") -> str:
        """The name of an announced item: a request, or the cache id of one."""
        return self._cache[item].name if type(item) is int else item.name

    def submit(self, rank: int, requests: list["Request | int"], now: float,
               since: float | None = None) -> None:
        """Record requests from `rank` (full requests, or cache ids of unchanged ones).

        `since`: when the rank submitted them, if before `now` (a request that waited on its
        rank for the others before it came here): stalls and timeouts count from then.
        """
        since = now if since is None else min(since, now)
        for item in requests:
            request = self._cache[item] if isinstance(item, int) else item
            by_rank = self._submitted.setdefault(request.name, {})
            if rank in by_rank:
                raise ValueError(
                    f"rank {self._run_ranks[rank]} submitted tensor {request.name!r} twice "
                    "before it completed: "
                    "give concurrent collectives distinct names"
                )
            by_rank[rank] = request
            if len(by_rank) == 1:
                _insert_in_time_order(self._waiting_since, request.name, since)
                _insert_in_time_order(self._partial_since, request.name, since)
            if request.kind == "join":
                self._joined.append(rank)
                for name in list(self._submitted):  # joined ranks may complete waiting names
                    self._mark_if_ready(name, now)
            else:
                self._mark_if_ready(request.name, now)

    def _mark_if_ready(self, name: str, now: float) -> None:
        submitted = self._submitted[name]
        if name in self._ready:
            return
        if len(submitted) < self.size:
            if _any(submitted).kind == "join" or len(submitted.keys() | set(self._joined)) < self.size:
                return
        self._ready[name] = None
        self._waiting_since.pop(name, None)
        self._partial_since.pop(name, None)
        if self._ready_since is None:
            self._ready_since = now

    @property
    def has_outstanding(self) -> bool:
        """Do some names wait here for ranks that have not submitted them (or joined)?"""
        return bool(self._submitted) or bool(self._joined)

    def ranks_waiting(self) -> set[int]:
        """The ranks that wait for the next cycle: each has submitted a name that has not run,
        or has joined (ranks counted 0..size-1).

        >>> coordinator = Coordinator((0, 1, 2), 1 << 20, 0.001, 60.0)
        >>> coordinator.submit(1, [Request("grad", "allreduce", torch.float32, (4,))], now=0.0)
        >>> coordinator.ranks_waiting()
        {1}
        """
        waiting = set(self._joined)
        for by_rank in self._submitted.values():
            waiting.update(by_rank)
        return waiting

    def note_waited(self, names: list[str]) -> None:
        """Some rank is blocked in synchronize() on these names: don't hold them for fusion."""
        self._waited.update(names)

    def next_deadline(self) -> float | None:
        """When `take_cycle` will have something to do even if no message arrives."""
        deadlines = []
        if self._ready_since is not None:
            deadlines.append(self._ready_since + self.cycle_time_s)
        if self._waiting_since:
            deadlines.append(next(iter(self._waiting_since.values())) + self._stall_after_s)
        if self._partial_since:
            deadlines.append(next(iter(self._partial_since.values())) + self.timeout_s)
        return min(deadlines) if deadlines else None

    @property
    def _stall_after_s(self) -> float:
        """The stall report comes at the stall time, or at the timeout if that is sooner, so
        that a collective never fails without its stall report before it."""
        return min(self.stall_time_s, self.timeout_s)

    def take_cycle(self, now: float, flush: bool = False) -> Cycle | None:
        """The responses to run now, or None to keep collecting (cycle window still open).

        `flush` runs whatever is ready at once: ranks in lockstep batch by cycle instead.
        """
        if not self._ready:
            return None
        flush = (
            flush
            or any(name in self._waited for name in self._ready)
            or now - self._ready_since >= self.cycle_time_s
            or sum(_any(self._submitted[name]).nbytes for name in self._ready) >= self.fusion_threshold
        )
        if not flush:
            return None
        cycle = Cycle(responses=[])
        answered: list[tuple[Response, Request]] = []
        for name in self._ready:
            requests = self._submitted.pop(name)
            self._waited.discard(name)
            response = self._respond(name, requests)
            request = _any(requests)
            if response.error is None:
                self._remember(request, cycle)
            answered.append((response, request))
        self._ready.clear()
        self._ready_since = None
        cycle.responses = fuse(answered, self.fusion_threshold, bool(self._joined))
        return cycle

    def stall_warnings(self, now: float, reporter: int | None = None) -> list[str]:
        """One warning per tensor that some ranks submitted and others have not, for too long.

        `reporter`: only the tensors whose lowest submitting rank (in the ring) is this one.
        Replicas on every rank then warn once between them, each from a rank that waits.
        """
        warnings = []
        for name, since in list(self._waiting_since.items()):
            if now - since < self._stall_after_s:
                break  # oldest first: the rest are younger still
            have = sorted(self._submitted[name])
            if reporter is not None and have[0] != reporter:
                continue
            del self._waiting_since[name]
            missing = sorted(set(range(self.size)) - set(have))
            warnings.append(
                f"stall: tensor {name!r} was submitted by ranks {self._named(have)} "
                f"{now - since:.0f} s ago, but ranks {self._named(missing)} have not submitted "
                f"it{self._instead(missing)}. Ranks may "
                "be calling collectives in different orders or with different names, or one "
                f"rank skipped a step.{_unnamed_hint(name)}"
            )
        return warnings

    def expired(self, now: float) -> dict[str, str]:
        """The collectives that some ranks submitted and others never did, for `timeout_s`:
        name -> why it failed. (A `join` waits for the other ranks' data to run out, however
        long that takes: it never expires.)"""
        expired = {}
        for name, since in self._partial_since.items():
            if now - since < self.timeout_s:
                break  # oldest first: the rest are younger still
            request = _any(self._submitted[name])
            if request.kind == "join":
                continue
            have = sorted(self._submitted[name])
            missing = sorted(set(range(self.size)) - set(have) - set(self._joined))
            expired[name] = (
                f"{request.kind} of tensor {name!r} timed out after {self.timeout_s:g} s "
                f"(DDL_MAGIC_TIMEOUT): ranks {self._named(missing)} never submitted it, ranks "
                f"{self._named(have)} did{self._instead(missing)}. The ranks that did not are "
                "alive but elsewhere in their code: a different order of collectives, a "
                f"skipped step, a long computation on one rank.{_unnamed_hint(name)}")
        return expired

    def _instead(self, ranks: list[int]) -> str:
        """What `ranks` submitted that others have not, as " (rank 2 waits on 'b' instead)"."""
        waits = []
        for rank in ranks:
            names = [repr(name) for name, by_rank in self._submitted.items()
                     if rank in by_rank and name not in self._ready]
            if names:
                listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                waits.append(f"rank {self._run_ranks[rank]} waits on {listed}")
        return f" ({'; '.join(waits)} instead)" if waits else ""

    def _named(self, ranks: list[int]) -> list[int]:
        return [self._run_ranks[rank] for rank in ranks]

    def _respond(self, name: str, requests: dict[int, Request]) -> Response:
        first = requests[min(requests)]  # the reference the others are compared with
        if first.kind == "join":
            last = self._joined[-1]
            self._joined.clear()
            return Response("join", (name,), last_joined_rank=last)
        ranks = sorted(requests)
        if (len(ranks) == self.size and first.kind != "allgather"
                and all(request is first for request in requests.values())):
            return Response(first.kind, (name,))  # every rank sent the same cached request
        disagreeing = [rank for rank in ranks[1:] if not requests[rank].agrees_with(first)]
        if disagreeing:
            details = "; ".join(f"rank {self._run_ranks[rank]}: {requests[rank].describe()}"
                                for rank in [ranks[0]] + disagreeing)
            return Response(first.kind, (name,), error=(
                f"mismatched collective for tensor {name!r} between ranks "
                f"{self._named([ranks[0]] + disagreeing)}: {details}. Every rank must submit the same shape, "
                f"dtype and op under one name.{_unnamed_hint(name)}"
            ))
        absent = sorted(set(range(self.size)) - set(requests))
        if absent and first.kind != "allreduce":
            return Response(first.kind, (name,), error=(
                f"{first.kind} of {name!r} cannot run: ranks {absent} have called join(). "
                "After join() only allreduce continues (joined ranks contribute zeros)."
            ))
        if first.kind == "allgather":
            dims = tuple(requests[rank].shape[0] if requests[rank].shape else 1
                         for rank in range(self.size))
            return Response("allgather", (name,), first_dims=dims)
        return Response(first.kind, (name,))

    def _remember(self, request: Request, cycle: Cycle) -> None:
        if (request in self._cache_id_of or request.kind == "allgather"
                or ".noname." in request.name or len(self._cache) >= CACHE_CAPACITY):
            # Allgather shapes vary per rank; an unnamed op's name is never seen again; and the
            # cache stays bounded when a program makes up new names as it goes.
            return
        cache_id = len(self._cache)
        self._cache[cache_id] = request
        self._cache_id_of[request] = cache_id
        cycle.cache_updates[cache_id] = request


def fuse(answered: list[tuple[Response, Request]], threshold: int,
         joined: bool = False) -> list[Response]:
    """The responses to run, in order: allreduces of the same dtype, op, scaling and device
    fused into one response of at most `threshold` bytes (each group where its first
    member was), everything else as it is. `joined`: some ranks have joined, and take part
    with zeros of the shapes the responses carry.

    >>> grad = lambda name: Request(name, "allreduce", torch.float32, (256,))
    >>> [r.names for r in fuse([(Response("allreduce", (n,)), grad(n)) for n in "abc"], 2048)]
    [('a', 'b'), ('c',)]
    """
    slots: list[Response | list[Request]] = []  # a list is a fusion group still filling up
    groups: dict[tuple, list[Request]] = {}
    group_bytes: dict[tuple, int] = {}
    for response, request in answered:
        if response.error is not None or response.kind != "allreduce":
            slots.append(response)
            continue
        key = (request.dtype, request.op, request.prescale, request.postscale, request.device)
        if key in groups and group_bytes[key] + request.nbytes <= threshold:
            groups[key].append(request)
            group_bytes[key] += request.nbytes
        else:
            groups[key] = [request]
            group_bytes[key] = request.nbytes
            slots.append(groups[key])
    return [Response("allreduce", tuple(request.name for request in slot),
                     for_joined_ranks=tuple(slot) if joined else ())
            if isinstance(slot, list) else slot
            for slot in slots]


def _unnamed_hint(name: str) -> str:
    """For an operation named by call order (`allreduce.noname.7`): what went wrong, and the fix.

    Unnamed operations are numbered per kind on each rank, so two ranks agree on a name only
    while they have made the same unnamed calls in the same order.
    """
    kind, unnamed, _ = name.partition(".noname.")
    if not unnamed:
        return ""
    return (f" {name!r} is an unnamed {kind}, matched across ranks by call order: the ranks' "
            f"sequences of unnamed {kind} calls diverged at this call or before it (a rank made "
            "one more or one fewer, for instance after catching an exception). Pass name= to "
            "collectives so that ranks match them by name.")


def _insert_in_time_order(since_by_name: dict[str, float], name: str, since: float) -> None:
    """Add `name`, keeping the dict oldest first (`stall_warnings` and `expired` stop at the
    first name too young); `since` is rarely older than the newest already there."""
    newest = next(reversed(since_by_name.values()), -math.inf)
    since_by_name[name] = since
    if since < newest:
        ordered = sorted(since_by_name.items(), key=lambda item: item[1])
        since_by_name.clear()
        since_by_name.update(ordered)


def _any(requests: dict[int, Request]) -> Request:
    """One rank's request for a name (they agree, or the response is an error)."""
    return next(iter(requests.values()))
