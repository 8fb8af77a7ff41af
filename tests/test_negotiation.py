"""Rank 0's coordinator: readiness, agreement, fusion, the response cache and stall warnings."""

import torch

from ddl_magic.runtime.negotiation import Coordinator, Request, RequestCache


def allreduce(name, numel=4, dtype=torch.float32, op=0):
    return Request(name, "allreduce", dtype, (numel,), op=op)


def coordinator(size=2, fusion=1 << 20, cycle=0.001, stall=60.0):
    return Coordinator(tuple(range(size)), fusion_threshold=fusion, cycle_time_s=cycle, stall_time_s=stall)


def test_a_name_is_ready_only_when_every_rank_submitted_it():
    c = coordinator(size=3)
    c.submit(0, [allreduce("a")], now=0)
    c.submit(2, [allreduce("a")], now=0)
    assert c.take_cycle(now=1) is None
    c.submit(1, [allreduce("a")], now=0)
    assert [r.names for r in c.take_cycle(now=1).responses] == [("a",)]


def test_responses_follow_readiness_order_not_submission_order():
    c = coordinator()
    c.submit(0, [allreduce("a", dtype=torch.float16), allreduce("b", dtype=torch.int32)], now=0)
    c.submit(1, [allreduce("b", dtype=torch.int32)], now=0)
    c.submit(1, [allreduce("a", dtype=torch.float16)], now=0)
    assert [r.names for r in c.take_cycle(now=1).responses] == [("b",), ("a",)]


def test_the_ranks_waiting_for_a_cycle_are_those_with_a_name_outstanding_or_joined():
    c = coordinator(size=4)
    assert c.ranks_waiting() == set()
    c.submit(1, [allreduce("a")], now=0)
    c.submit(2, [allreduce("a"), allreduce("b")], now=0)
    assert c.ranks_waiting() == {1, 2}
    c.submit(3, [Request("join", "join", torch.uint8, ())], now=0)
    assert c.ranks_waiting() == {1, 2, 3}
    c.submit(0, [allreduce("a"), allreduce("b")], now=0)
    c.take_cycle(now=1, flush=True)  # a ran, with the joined rank's zeros; b waits for rank 1
    assert c.ranks_waiting() == {0, 2, 3}  # rank 1 alone waits for nothing: it is busy

def test_cycle_window_holds_ready_tensors_unless_someone_waits():
    c = coordinator(cycle=0.5)
    c.submit(0, [allreduce("a")], now=0)
    c.submit(1, [allreduce("a")], now=0)
    assert c.take_cycle(now=0.1) is None
    assert c.next_deadline() == 0.5
    c.note_waited(["a"])
    assert c.take_cycle(now=0.1).responses[0].names == ("a",)


def test_same_dtype_and_op_fuse_up_to_the_threshold():
    c = coordinator(fusion=40)  # 40 bytes: two tensors of 4 float32
    names = ["a", "b", "c", "d"]
    requests = [allreduce(n) for n in names] + [allreduce("e", dtype=torch.float64)]
    for rank in (0, 1):
        c.submit(rank, requests, now=0)
    groups = [r.names for r in c.take_cycle(now=1).responses]
    assert groups == [("a", "b"), ("c", "d"), ("e",)]


def test_different_ops_never_fuse():
    c = coordinator()
    for rank in (0, 1):
        c.submit(rank, [allreduce("a", op=1), allreduce("b", op=3)], now=0)
    assert [r.names for r in c.take_cycle(now=1).responses] == [("a",), ("b",)]


def test_mismatched_shapes_give_an_error_naming_tensor_and_ranks():
    c = coordinator(size=3)
    c.submit(0, [allreduce("w", numel=4)], now=0)
    c.submit(1, [allreduce("w", numel=4)], now=0)
    c.submit(2, [allreduce("w", numel=5)], now=0)
    (response,) = c.take_cycle(now=1).responses
    assert "'w'" in response.error and "[0, 2]" in response.error
    assert "float32[5]" in response.error
    assert "unnamed" not in response.error  # a named op's mismatch is not about call order


def test_a_mismatch_of_unnamed_ops_says_the_ranks_calls_diverged_and_where():
    c = coordinator()
    c.submit(0, [allreduce("allreduce.noname.4", numel=2)], now=0)
    c.submit(1, [allreduce("allreduce.noname.4", numel=1)], now=0)
    (response,) = c.take_cycle(now=1).responses
    assert ("'allreduce.noname.4' is an unnamed allreduce, matched across ranks by call order: "
            "the ranks' sequences of unnamed allreduce calls diverged at this call or before it"
            in response.error)
    assert "Pass name= to collectives" in response.error


def test_allgather_may_differ_in_first_dimension_only():
    c = coordinator()
    c.submit(0, [Request("g", "allgather", torch.float32, (2, 3))], now=0)
    c.submit(1, [Request("g", "allgather", torch.float32, (5, 3))], now=0)
    (response,) = c.take_cycle(now=1).responses
    assert response.error is None and response.first_dims == (2, 5)


def test_unchanged_requests_are_resubmitted_as_cache_ids():
    c = coordinator()
    cache = RequestCache()
    request = allreduce("grad")
    assert cache.encode(request) == request
    c.submit(0, [request], now=0)
    c.submit(1, [request], now=0)
    cycle = c.take_cycle(now=1)
    cache.update(cycle.cache_updates)
    cache_id = cache.encode(request)
    assert isinstance(cache_id, int)
    c.submit(0, [cache_id], now=2)
    c.submit(1, [cache_id], now=2)
    assert c.take_cycle(now=3).responses[0].names == ("grad",)
    assert cache.encode(allreduce("grad", numel=8)) != cache_id  # a changed shape is sent in full


def test_stall_warning_names_tensor_and_missing_ranks_once():
    c = coordinator(size=3, stall=10)
    c.submit(0, [allreduce("slow")], now=0)
    c.submit(2, [allreduce("slow")], now=0)
    assert c.stall_warnings(now=5) == []
    (warning,) = c.stall_warnings(now=11)
    assert "'slow'" in warning and "ranks [1]" in warning
    assert c.stall_warnings(now=30) == []


def test_a_stall_of_unnamed_ops_names_what_the_missing_rank_waits_on_instead():
    c = coordinator(size=3, stall=10)
    c.submit(0, [allreduce("allreduce.noname.4")], now=0)
    c.submit(1, [allreduce("allreduce.noname.4")], now=0)
    c.submit(2, [allreduce("allreduce.noname.5")], now=0)  # rank 2 made one unnamed call more
    warning = c.stall_warnings(now=11)[0]
    assert ("tensor 'allreduce.noname.4' was submitted by ranks [0, 1] 11 s ago, but ranks [2] "
            "have not submitted it (rank 2 waits on 'allreduce.noname.5' instead)" in warning)
    assert "sequences of unnamed allreduce calls diverged at this call or before it" in warning


def test_the_cache_stays_bounded_and_skips_unnamed_ops():
    from ddl_magic.runtime.negotiation import CACHE_CAPACITY

    c = coordinator(size=1)
    c.submit(0, [allreduce(f"allreduce.noname.{i}") for i in range(10)], now=0)
    assert c.take_cycle(now=1).cache_updates == {}
    c.submit(0, [allreduce(f"grad.{i}") for i in range(CACHE_CAPACITY + 10)], now=2)
    assert len(c.take_cycle(now=3).cache_updates) == CACHE_CAPACITY


def cached_ids(c, requests, size=2):
    """Negotiate `requests` once on every rank in lockstep; their cache ids."""
    cache = RequestCache()
    cycle = c.agree([list(requests)] * size, now=0)
    cache.update(cycle.cache_updates)
    return [cache.encode(request) for request in requests]


def test_lockstep_agreement_answers_a_repeated_step_from_its_memo_as_take_cycle_would():
    c = coordinator(fusion=40)  # two tensors of 4 float32 per fused response
    ids = cached_ids(c, [allreduce(n) for n in "abc"])
    first = c.agree([ids, ids], now=1)
    assert [r.names for r in first.responses] == [("a", "b"), ("c",)]
    c.take_cycle = None  # a memo hit needs no decision: it would fail here if one were taken
    again = c.agree([ids, ids], now=2)
    assert again.responses == first.responses and again.responses is not first.responses


def test_lockstep_agreement_decides_afresh_when_ranks_differ_or_something_is_outstanding():
    c = coordinator()
    a, b = cached_ids(c, [allreduce("a"), allreduce("b")])
    c.agree([[a, b], [a, b]], now=1)  # the step, remembered
    assert c.agree([[a, b], [b]], now=2).responses[0].names == ("b",)  # rank 1 is behind on a
    # a is outstanding now: the same step must not be answered from the memo (a runs once)
    assert c.agree([[], [a]], now=3).responses[0].names == ("a",)
    assert [r.names for r in c.agree([[a, b], [a, b]], now=4).responses] == [("a", "b")]


def test_lockstep_agreement_never_remembers_a_mismatch():
    c = coordinator()
    (grad,) = cached_ids(c, [allreduce("grad")])
    wrong = allreduce("grad", numel=8)
    assert c.agree([[grad], [wrong]], now=1).responses[0].error is not None
    assert c.agree([[grad], [grad]], now=2).responses[0].error is None
