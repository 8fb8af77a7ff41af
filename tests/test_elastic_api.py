"""`hvd.elastic`, the rank's side of elastic training (Horovod's API).

- The reset loop (`run_fn`) as pure logic, with a fake state and a fake world re-forming:
  what runs, in which order, after a failure, a host change, a failure during the reset,
  a bug, and too many resets.
- `ElasticSampler`: no sample is done twice in an epoch across resets that change the
  world (hypothesis), and Horovod's bookkeeping of a partial epoch.
- On 2 real ranks: commit, restore and sync of a model, Adam and a sampler; a commit that
  allocates nothing after the first; a host-update notice that one rank heard interrupts
  both at the same commit, and the world re-forms without a rollback; and `hvd.elastic.run` after a `HorovodInternalError` raised on
  every rank, or on one rank while the other waits in an allreduce: the last commit is
  restored, the same world re-formed, and training ends with the weights of a run that
  never failed; and a world re-formed smaller (a rendezvous standing in for the driver
  leaves a rank out): the survivors deal the rest of the epoch over the new ring.
"""

from __future__ import annotations

import collections
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddl_magic.runtime.errors import CollectiveMismatchError, HorovodInternalError, PeerLostError
from ddl_magic.runtime.world import Peer
from ddl_magic.torch.elastic import (ElasticRunFailed, ElasticSampler, HostsUpdatedInterrupt,
                                     ResetReason, WorldPlan, run_fn)
from ddl_magic.torch.elastic import sampler as sampler_module
from ddl_magic.torch.elastic.sampler import deal, epoch_order
from ranks import run_on_ranks


# ---- the reset loop, pure ------------------------------------------------------------------

class RecordedState:
    """A state that records which of its verbs the loop calls."""

    def __init__(self, log: list):
        self.log = log
        self.commit_count = 0

    def sync(self):
        self.log.append("sync")

    def restore(self):
        self.log.append("restore")

    def on_reset(self, formed_at=0.0):
        self.log.append("callbacks")

    def on_hosts_updated(self, timestamp, result):
        pass


def attempts_raising(log: list, *errors):
    """A function that raises `errors[i]` at its i-th attempt, then returns "done"."""
    def train(state):
        attempt = sum(1 for entry in log if entry == "run")
        log.append("run")
        if attempt < len(errors):
            raise errors[attempt]
        return "done"
    return train


def reform_recorded(log: list, failures: list | None = None):
    """A world re-forming that records its reason, raising `failures` first, one per call."""
    failures = list(failures or [])

    def reform(reason: ResetReason, error: str, commits: int) -> WorldPlan:
        log.append(f"reform:{reason.value}")
        if failures:
            raise failures.pop(0)
        return WorldPlan(1, 0, (Peer(0, "here", ("127.0.0.1", 1)),))
    return reform


def test_a_failure_restores_the_commit_reforms_the_world_runs_callbacks_syncs_and_runs_again():
    log = []
    train = run_fn(attempts_raising(log, PeerLostError(1, "b", "closed")), reform_recorded(log),
                   reset_limit=3)
    assert train(RecordedState(log)) == "done"
    assert log == ["sync", "run", "restore", "reform:failure", "callbacks", "sync", "run"]


def test_a_host_change_rolls_nothing_back_and_skips_the_sync_when_ranks_only_left():
    log = []
    train = run_fn(attempts_raising(log, HostsUpdatedInterrupt(skip_sync=True),
                                    HostsUpdatedInterrupt(skip_sync=False)),
                   reform_recorded(log), reset_limit=3)
    assert train(RecordedState(log)) == "done"
    assert log == ["sync", "run", "reform:hosts_updated", "callbacks", "run",
                   "reform:hosts_updated", "callbacks", "sync", "run"]


def test_a_failure_while_the_world_re_forms_starts_the_next_reset():
    log = []
    train = run_fn(attempts_raising(log, PeerLostError(1, "b", "closed")),
                   reform_recorded(log, failures=[PeerLostError(2, "c", "did not connect")]),
                   reset_limit=3)
    assert train(RecordedState(log)) == "done"
    assert log == ["sync", "run", "restore", "reform:failure", "restore", "reform:failure",
                   "callbacks", "sync", "run"]


def test_ranks_that_disagree_on_a_collective_have_a_bug_that_no_reset_would_fix():
    log = []
    mismatch = CollectiveMismatchError("allreduce 'grad': shapes differ")
    train = run_fn(attempts_raising(log, mismatch), reform_recorded(log), reset_limit=3)
    with pytest.raises(CollectiveMismatchError):
        train(RecordedState(log))
    assert log == ["sync", "run"]


def test_a_failure_that_repeats_ends_the_run_after_the_reset_limit():
    log = []
    always = [HorovodInternalError(f"failure {n}") for n in range(10)]
    train = run_fn(attempts_raising(log, *always), reform_recorded(log), reset_limit=2)
    with pytest.raises(ElasticRunFailed, match="reset 2 times") as raised:
        train(RecordedState(log))
    assert log.count("reform:failure") == 2 and log.count("run") == 3
    assert raised.value.__cause__ is always[2]


def test_the_reset_limit_comes_from_the_environment_and_a_bad_value_is_refused(monkeypatch):
    log = []
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_RESET_LIMIT", "0")
    train = run_fn(attempts_raising(log, HorovodInternalError("lost")), reform_recorded(log))
    with pytest.raises(ElasticRunFailed):
        train(RecordedState(log))
    monkeypatch.setenv("DDL_MAGIC_ELASTIC_RESET_LIMIT", "many")
    with pytest.raises(ValueError, match="DDL_MAGIC_ELASTIC_RESET_LIMIT='many'"):
        run_fn(attempts_raising([]), reform_recorded([]))(RecordedState([]))


# ---- ElasticSampler, pure -------------------------------------------------------------------

def test_an_epoch_is_dealt_as_distributed_sampler_deals_it_padding_the_last_round():
    order = epoch_order(7, shuffle=True, seed=3, epoch=2)
    assert sorted(order) == list(range(7)) and order == epoch_order(7, True, 3, 2)
    shares = [deal(order, rank, 3) for rank in range(3)]
    assert [len(share) for share in shares] == [3, 3, 3]
    assert collections.Counter(sum(shares, [])) == collections.Counter(order + order[:2])
    assert deal([5], rank=2, size=4) == [5] and deal([], rank=0, size=2) == []


def as_rank(rank: int, size: int):
    """The sampler sees itself as `rank` of `size` (it asks hvd.rank() and hvd.size())."""
    return mock.patch.multiple(sampler_module, rank=lambda: rank, size=lambda: size)


def samplers_for(world: int, dataset, seed: int, shuffle: bool) -> list[ElasticSampler]:
    samplers = []
    for rank in range(world):
        with as_rank(rank, world):
            samplers.append(ElasticSampler(dataset, shuffle=shuffle, seed=seed))
    return samplers


@settings(max_examples=150, deadline=None)
@given(data=st.data(), length=st.integers(1, 60), batch=st.integers(1, 4),
       worlds=st.lists(st.integers(1, 4), min_size=2, max_size=4), shuffle=st.booleans(),
       seed=st.integers(0, 5))
def test_no_sample_is_done_twice_in_an_epoch_across_resets_that_change_the_world(
        data, length, batch, worlds, shuffle, seed):
    dataset = list(range(length))
    samplers = samplers_for(worlds[0], dataset, seed, shuffle)
    done = collections.Counter()  # samples whose step survived: committed, or in the last world
    padding = 0  # samples dealt twice to fill the last round: done only by a world that ends the epoch
    for world, next_world in zip(worlds, worlds[1:]):
        batches = data.draw(st.integers(0, samplers[0].num_samples // batch))
        committed = data.draw(st.integers(0, batches))
        if committed * batch >= samplers[0].num_samples:
            padding += samplers[0].total_size - len(samplers[0].remaining_indices)
        points = {}
        for index in range(batches):  # every rank steps through its share in step
            for sampler in samplers:
                if index == committed:
                    points[id(sampler)] = sampler.commit_point()
                if index < committed:
                    done.update(sampler.get_indices(index, batch))
                sampler.record_batch(index, batch)
        for sampler in samplers:  # a failure: back to the commit, then the new world
            sampler.return_to(points.get(id(sampler), sampler.commit_point()))
        survivors = samplers[:next_world]  # rank 0, the oldest, always survives
        samplers = survivors + samplers_for(next_world, dataset, seed, shuffle)[len(survivors):]
        latest = samplers[0].state_dict()  # the sync: rank 0's state to every rank
        for rank, sampler in enumerate(samplers):
            with as_rank(rank, next_world):
                sampler.load_state_dict(latest)
    for sampler in samplers:  # the last world finishes the epoch
        done.update(sampler)
    padding += samplers[0].total_size - len(samplers[0].remaining_indices)
    assert set(done) == set(dataset), "a sample was never done"
    assert sum(done.values()) - length <= padding, f"done twice: {done}"


def test_a_partial_epoch_is_committed_restored_and_dealt_again_as_horovod_counts_it():
    dataset = list(range(16))
    with as_rank(0, 2):
        sampler = ElasticSampler(dataset, shuffle=True)
        assert len(sampler) == 8 and sampler.processed_num == 0
        sampler.record_batch(0, 2)
        sampler.record_batch(1, 2)
        point = sampler.commit_point()
        sampler.record_batch(2, 2)
        sampler.return_to(point)
        assert sampler.processed_num == 4  # this rank's 4 since the deal
        assert sampler.state_dict() == {"epoch": 0, "processed_num": 8}  # both ranks' 4
        sampler.load_state_dict(sampler.state_dict())
        assert sampler.processed_num == 8 and len(sampler) == 4
        assert set(sampler.remaining_indices).isdisjoint(epoch_order(16, True, 0, 0)[:8])
        sampler.set_epoch(1)
        assert sampler.processed_num == 0 and len(sampler) == 8


def test_recorded_indices_must_be_the_next_ones_the_sampler_gave():
    with as_rank(1, 2):
        sampler = ElasticSampler(list(range(10)), shuffle=False)
        sampler.record_indices(sampler.get_indices(0, 2))
        assert sampler.processed_num == 2
        with pytest.raises(ValueError, match=r"expected this rank's next 2 indices \[5, 7\]"):
            sampler.record_indices([1, 3])


# ---- on real ranks ---------------------------------------------------------------------------

def check_commit_restore_and_sync(hvd) -> list[str]:
    """Horovod's contract: sync gives rank 0's values, restore goes back to the last commit
    (or the sync), commit keeps what was changed."""
    import torch

    failures = []
    torch.manual_seed(hvd.rank())  # every rank starts with other weights
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    sampler = ElasticSampler(list(range(16)))
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, batch=20 + hvd.rank())
    state.sync()
    synced = {name: value.clone() for name, value in model.state_dict().items()}
    everyone = hvd.allgather_object(synced)
    if any(not torch.equal(theirs[name], synced[name]) for theirs in everyone for name in synced):
        failures.append("sync: the ranks' weights differ")
    if state.batch != 20:
        failures.append(f"sync: batch is {state.batch}, rank 0's was 20")

    def step():
        optimizer.zero_grad()
        model(torch.ones(4, 3)).pow(2).sum().backward()
        optimizer.step()
        sampler.record_batch(0, 2)

    step()
    state.batch = 21
    state.restore()
    if any(not torch.equal(model.state_dict()[name], synced[name]) for name in synced):
        failures.append("restore after sync: weights are not the synced ones")
    if optimizer.state or state.batch != 20 or sampler.processed_num != 0:
        failures.append("restore after sync: Adam's state, batch or the sampler moved on")
    step()
    state.batch = 22
    state.commit()
    committed = {name: value.clone() for name, value in model.state_dict().items()}
    moments = {key: value.clone() for key, value in optimizer.state[model.weight].items()}
    step()
    state.batch = 23
    state.restore()
    if any(not torch.equal(model.state_dict()[name], committed[name]) for name in committed):
        failures.append("restore after commit: weights are not the committed ones")
    if any(not torch.equal(optimizer.state[model.weight][key], value)
           for key, value in moments.items()):
        failures.append("restore after commit: Adam's moments or step are not the committed ones")
    if state.batch != 22 or sampler.processed_num != 2:
        failures.append(f"restore after commit: batch {state.batch}, "
                        f"sampler at {sampler.processed_num}")
    step()  # a restored optimizer steps on: its state is its own, not the commit's
    if torch.equal(optimizer.state[model.weight]["exp_avg"],
                   state._handlers["optimizer"]._copies.saved[1]):
        failures.append("the optimizer's state shares memory with the commit")
    state.restore()
    state.sync()
    if sampler.processed_num != 2 * hvd.size() or len(sampler) != (16 - 2 * hvd.size()) // 2:
        failures.append(f"sync: the sampler did not deal again what is left "
                        f"({sampler.processed_num} done, {len(sampler)} here)")
    return failures


def check_a_commit_allocates_nothing_after_the_first(hvd) -> list[str]:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)

    def step():
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()

    def saved_storage():
        copies = [state._handlers[name]._copies.saved for name in ("model", "optimizer")]
        return [tensor.untyped_storage().data_ptr() for tensor in sum(copies, [])]

    step()
    state.commit()  # the first commit of Adam's state allocates its copies
    first = saved_storage()
    failures = []
    for epoch in range(3):
        step()
        state.epoch = epoch
        state.commit()
        if saved_storage() != first:
            failures.append(f"commit {epoch + 2} allocated new copies")
        live = list(model.state_dict().values())
        if not all(torch.equal(s, t) for s, t in zip(state._handlers["model"]._copies.saved, live)):
            failures.append(f"commit {epoch + 2} did not copy the model")
    return failures


def check_a_host_notice_heard_by_one_rank_interrupts_every_rank_at_the_same_commit(hvd):
    import time

    attempts = []

    @hvd.elastic.run
    def train(state):
        attempts.append(hvd.size())
        state.commit()  # nothing announced yet
        if len(attempts) == 1 and hvd.rank() == 1:
            hvd.elastic.notify_hosts_updated(time.time(), hvd.elastic.HostUpdateResult.removed)
        state.commit()  # rank 1 heard of a removal: both are interrupted here, once
        return len(attempts)

    state = hvd.elastic.ObjectState(batch=0)
    outcome = train(state)
    timestamps = hvd.allgather_object(state._last_updated_timestamp)
    failures = [] if outcome == 2 else [f"{outcome} attempts, expected 2"]
    if len(set(timestamps)) != 1:
        failures.append(f"the ranks agreed on different notices: {timestamps}")
    return failures


def check_sharded_optimizer_state_is_refused(hvd) -> list[str]:
    import torch

    model = torch.nn.Linear(4, 4)
    sharded = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()),
                                       named_parameters=model.named_parameters(),
                                       shard_optimizer_state=True)
    try:
        hvd.elastic.TorchState(model, sharded)
    except NotImplementedError as refusal:
        return [] if "shard_optimizer_state" in str(refusal) else [str(refusal)]
    return ["a TorchState took an optimizer whose state a lost rank would take with it"]


STATE_CHECKS = [check_commit_restore_and_sync, check_a_commit_allocates_nothing_after_the_first,
                check_a_host_notice_heard_by_one_rank_interrupts_every_rank_at_the_same_commit,
                check_sharded_optimizer_state_is_refused]


def run_state_checks():
    import ddl_magic.torch as hvd

    hvd.init()
    report = {check.__name__: check(hvd) for check in STATE_CHECKS}
    hvd.shutdown()
    return report


@pytest.fixture(scope="module")
def state_reports():
    return run_on_ranks(run_state_checks, 2)


@pytest.mark.parametrize("check", [check.__name__ for check in STATE_CHECKS])
def test_state_on_two_ranks(state_reports, check):
    assert {rank: report[check] for rank, report in enumerate(state_reports)
            if report[check]} == {}


def train_elastic(hvd, fail_at: int | None, failing_ranks: tuple[int, ...]):
    """Six steps of DistributedOptimizer training, committing every second step; at step
    `fail_at` the ranks in `failing_ranks` raise a HorovodInternalError (once). Returns the
    final weights and, per attempt, (the step it started at, the world's size)."""
    import torch

    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    x = torch.arange(8.0).reshape(2, 4) + hvd.rank()
    attempts, raised = [], []

    @hvd.elastic.run
    def train(state):
        attempts.append((state.step, hvd.size()))
        while state.step < 6:
            optimizer.zero_grad()
            if state.step == fail_at and hvd.rank() in failing_ranks and not raised:
                raised.append(state.step)  # before sending gradients: the others wait for them
                raise HorovodInternalError(f"injected at step {state.step}")
            model(x).pow(2).mean().backward()
            optimizer.step()
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
        return model.weight.detach().clone()

    weights = train(hvd.elastic.TorchState(model, optimizer, step=0))
    return weights, attempts


def run_training_with_failures():
    import ddl_magic.torch as hvd

    hvd.init()
    outcomes = {"never fails": train_elastic(hvd, None, ()),
                "every rank raises": train_elastic(hvd, 3, (0, 1)),
                "rank 1 raises, rank 0 waits in the allreduce": train_elastic(hvd, 5, (1,))}
    hvd.shutdown()
    return outcomes


@pytest.fixture(scope="module")
def trainings():
    return run_on_ranks(run_training_with_failures, 2, timeout_s=120)


@pytest.mark.parametrize("schedule, resumed_at", [("every rank raises", 2),
                                                  ("rank 1 raises, rank 0 waits in the allreduce", 4)])
def test_a_failure_resumes_from_the_last_commit_in_the_same_world(trainings, schedule, resumed_at):
    import torch

    for outcomes in trainings:
        weights, attempts = outcomes[schedule]
        assert attempts == [(0, 2), (resumed_at, 2)]
        assert torch.equal(weights, outcomes["never fails"][0])
    assert torch.equal(trainings[0][schedule][0], trainings[1][schedule][0])


class ShrinkTo:
    """A rendezvous standing in for the driver: the next world is the first `size` ranks of
    the one that ended, at the same addresses; the others are left out."""

    def __init__(self, size: int):
        self.size = size

    def next_world(self, request):
        from ddl_magic.runtime import context

        peers = tuple(context.bootstrap.peers[:self.size])
        rank = request.rank if request.rank < self.size else None
        return WorldPlan(request.generation + 1, rank, peers)


def train_until_a_rank_leaves():
    """24 samples dealt over 3 ranks, 2 per batch, a commit after every batch; at the third
    batch rank 2 fails, and the driver (`ShrinkTo(2)`) re-forms the world without it."""
    import torch

    import ddl_magic.torch as hvd

    hvd.elastic.install(ShrinkTo(2))
    hvd.init()
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(1, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    sampler = ElasticSampler(list(range(24)), shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, batches=0)
    done = []  # this rank's samples whose step was committed (the state is rank 0's after a sync)
    sizes_at_reset = []
    state.register_reset_callbacks([lambda: sizes_at_reset.append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        for batch_idx in range(len(state.sampler) // 2):
            indices = state.sampler.get_indices(batch_idx, 2)
            if state.batches == 2 and hvd.rank() == 2:
                raise HorovodInternalError("rank 2's host is going away")
            optimizer.zero_grad()
            model(torch.tensor([[float(i)] for i in indices])).sum().backward()
            optimizer.step()
            state.sampler.record_batch(batch_idx, 2)
            state.batches += 1
            state.commit()
            done.extend(indices)
        return "finished"

    try:
        outcome = train(state)
    except hvd.elastic.RankRetired:
        outcome = "retired"
    weights = model.weight.detach().clone()
    return {"outcome": outcome, "done": done, "size": hvd.size() if hvd.is_initialized()
            else None, "sizes_at_reset": sizes_at_reset, "weights": weights}


def test_the_survivors_re_form_a_smaller_ring_and_deal_the_rest_of_the_epoch_over_it():
    import torch

    ranks = run_on_ranks(train_until_a_rank_leaves, 3)
    assert [r["outcome"] for r in ranks] == ["finished", "finished", "retired"]
    assert [r["size"] for r in ranks] == [2, 2, None]
    assert [r["sizes_at_reset"] for r in ranks[:2]] == [[2], [2]]
    # Rank 2's first two batches were committed before it left; the rest went to the others.
    done = [index for r in ranks for index in r["done"]]
    assert sorted(done) == list(range(24))
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])
