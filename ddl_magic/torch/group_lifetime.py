"""On a launched rank, a destroyed torch.distributed process group lives until the process exits.

Why: torch's gloo process group joins its worker threads in its C++ destructor while the
destroying thread holds Python's GIL. A worker that is just dropping its last finished
collective needs the GIL too (the work's captured `at::ThreadLocalState` releases a Python
object), so each waits for the other for ever: a stack dump of such a rank shows the main
thread in ``ProcessGroupGloo::~ProcessGroupGloo -> std::thread::join`` and a gloo thread in
``~AsyncAllreduceWork -> ~ThreadLocalState -> gil_scoped_acquire``. It is a race between the
last collective and the destruction. Plain DDP code loses it whenever the group dies within a
few milliseconds of the last allreduce: after `dist.destroy_process_group()` the group's last
owner is the DDP model, and a script's namespace (or a cell's, or a function's locals) is
dropped right after its last line, on the rank before it reports. Under `python script.py`
the same objects die only in the interpreter's finalisation, much later; ddl_magic ran 3 of 4
such runs into the deadlock.

A rank ends with `os._exit` right after it has reported, so a group nobody destroys costs
nothing: the rank keeps a reference to every group `destroy_process_group` lets go of, and
no destructor runs on the rank's path to its report.
"""

from __future__ import annotations

import functools

_destroyed_groups: list = []  # referenced until the process exits, never destroyed


def keep_destroyed_groups_alive() -> None:
    """Make `torch.distributed.destroy_process_group` keep the groups it destroys referenced
    (idempotent). For launched ranks only: a long-lived process would keep their threads."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    destroy = distributed_c10d.destroy_process_group
    if getattr(destroy, "keeps_groups_alive", False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is None or group is distributed_c10d.GroupMember.WORLD:
            _destroyed_groups.extend(distributed_c10d._world.pg_map)
        else:
            _destroyed_groups.append(group)
        destroy(group)

    destroy_process_group.keeps_groups_alive = True
    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
