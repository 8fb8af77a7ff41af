"""Elastic training, Horovod's API: the run goes on when ranks are lost or join.

    import ddl_magic.torch as hvd                     # was: import horovod.torch as hvd

    hvd.init()
    model, optimizer = Net(), torch.optim.Adam(...)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches_per_epoch):
                step()
                state.commit()                        # in memory: a failure resumes here
            state.batch = 0

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    state.register_reset_callbacks([lambda: set_lr(base_lr * hvd.size())])
    train(state)

What each part does: `state.py` (commit, restore, sync), `resets.py` (the loop that runs
the function again after a reset), `sampler.py` (data dealt out again over the new world),
`rendezvous.py` (how a rank re-forms its world), `notices.py` (host changes announced by
the driver), `exceptions.py`.


The driver's side of a reset (the rank's side is here)
=====================================================

Built for local runs and Spark: `driver/elastic.py` (the phases), `driver/elastic_plan.py`
(the decisions, pure), `launch/local.py` and `launch/spark.py` (replacements), the messages
in `wire/messages.py` and `rank/worker.py`'s `DriverRendezvous`; a pool's replacements
(8) are `driver/pool.py`'s.

A rank re-forms its world through the `ElasticRendezvous` that its worker installs
(`rendezvous.install`) before the user's code runs. Without one, a rank uses `SameWorld`:
a reset then reconnects the same ranks, which works while all of them live (tested), and
a lost rank ends the run as today. What the driver and the worker provide:

1. **The messages.** `ResetRequest` (rank -> driver: the world that ended, the rank's
   number in it, why, the error, its commit count) and `WorldPlan` (driver -> rank: the
   next world's number, this rank's number in it or None, the peer table) become frozen
   dataclasses in `wire/`, plus a "run cannot go on" answer carrying the reason, which
   the worker's `next_world` raises as `ElasticRunFailed`, and a host-update notice
   (`HostsUpdated`) that the worker passes to `notify_hosts_updated`. The worker's control thread (`rank/worker.py: _obey_driver`) dispatches by
   type, handing plans to the waiting `next_world`. After a plan the worker refreshes the
   rank's environment (`RANK`, `HOROVOD_RANK`, ... from `rank_environment`), which
   `reform_world` cannot reach from this layer.

2. **When a reset starts.** A rank's process ends (the factory or the Spark task reports
   it), or a rank asks (its collective raised `HorovodInternalError`). The survivors'
   collectives end by themselves: a peer that died or shut down closes its connections
   (`PeerLostError` at once), a stopped one is named after `DDL_MAGIC_PEER_TIMEOUT`. A
   survivor busy outside collectives asks at its next one. The driver collects a request
   from every live rank of the ended world, with a deadline (the peer timeout): a rank
   that has not asked by then is hung, and is killed and counted as lost.

3. **The new world.** Survivors, then replacements (local: forked from the factory;
   Spark: tasks where slots are free), up to `max_np`. New rank 0 is the oldest survivor
   (the lowest rank of the oldest generation): its state is the latest commit, and `sync`
   broadcasts from rank 0. Survivors keep their order; a survivor's ring listener, host
   and secret are unchanged (they live in its bootstrap across resets), so the peer table
   is built from the registrations the driver already has. Every member gets the same
   generation and table; a rank left out (above `max_np`, on a blacklisted host) gets
   `rank=None` and raises `RankRetired`, which its worker reports as retired, exit 0.
   A replacement starts with `install(rendezvous, generation)`, runs the user's code from
   the top, and its `hvd.init()` joins the new world; its `hvd.elastic.run` then syncs
   with the survivors, who are waiting in the sync that follows their reset. The user's
   code must therefore run no collective before the decorated function (Horovod's rule).

4. **Below `min_np`.** The driver waits for ranks to come back or be started, at most
   `HOROVOD_ELASTIC_TIMEOUT` (600 s, Horovod's default; a shorter default is worth
   considering for notebooks), then answers "cannot go on" with how many ranks it had
   and needed; every waiting rank raises `ElasticRunFailed` with that message, and the
   run fails with it. `next_world` must never wait longer than that deadline plus a
   margin: every wait has a deadline.

5. **No endless restarts.** The driver counts failures per host and blacklists a host
   after a documented number (Horovod: at the first, with an optional cooldown); it
   stops the run after `--reset-limit` resets and when no host is left. The ranks bound
   resets themselves too (`DDL_MAGIC_ELASTIC_RESET_LIMIT`, default 10, see `resets.py`):
   the driver passes its limit in that variable so both agree.

6. **Graceful changes.** When a replacement that waited for room is ready (Spark: its
   task got a slot, e.g. on a host that came back), the driver sends every rank a
   host-update notice; each raises `HostsUpdatedInterrupt` at its next
   `commit()`/`check_host_updates()` (all at the same point: ranks agree on notices by a
   max-allreduce), then asks for the next world with reason `HOSTS_UPDATED`. Nothing is
   rolled back. Every world carries the time the driver formed it: a notice stamped
   earlier, even one that arrives during the reset, is already in it (`State.on_reset`).

7. **Spark.** Barrier mode gives gang scheduling but fails every task of the stage when
   one fails: a lost executor would take all the commits (they live in the ranks' memory)
   with it. An elastic Spark run is therefore one Spark job of one task per rank, so a
   task fails alone; a task Spark retries returns at once (a rank never runs twice behind
   the driver's back), and a rank dies with its task. A replacement is a new job, which
   waits for a free slot: the ranks left go on without it and it joins as in (6). Gang
   start is the driver's wait for every rank to register.

8. **What a reset does not carry over.** Process sets (every rank adds them again, in a
   reset callback), `torch.distributed` groups over the `ddl` backend, and the timeline
   recorder's ring-specific lanes. An elastic pool (`%horovod start --min-np`) keeps the
   survivors' namespaces; its replacements start empty, and the pool says which.
"""

from ...runtime.errors import HorovodInternalError
from .exceptions import ElasticRunFailed, HostsUpdatedInterrupt, HostUpdateResult, RankRetired
from .notices import notify_hosts_updated
from .rendezvous import (ElasticRendezvous, ResetReason, ResetRequest, SameWorld, WorldPlan,
                         install)
from .resets import run, run_fn
from .sampler import ElasticSampler
from .state import ObjectState, State, TorchState

__all__ = [
    "run", "run_fn", "State", "ObjectState", "TorchState", "ElasticSampler",
    "HorovodInternalError", "HostsUpdatedInterrupt", "HostUpdateResult", "RankRetired",
    "ElasticRunFailed", "notify_hosts_updated", "ElasticRendezvous", "ResetRequest",
    "WorldPlan", "ResetReason", "SameWorld", "install",
]
