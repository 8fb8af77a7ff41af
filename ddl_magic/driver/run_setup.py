"""What every run and every pool does before its first rank starts, in one place (`prepare_run`):
the launcher's checks, the ranks' environment, the run's id, folder and timeline path, and
its secret. `Job.run` and `Pool.start` both call it, so a one-shot run and a pool are set up,
named, pruned and checked alike.

Example::

    setup = prepare_run(2, LocalLauncher(), env={}, use_gpu=False, timeline_path=None)
    server = ControlServer(setup.secret, 2, task, RunSettings(setup.run_id, setup.env), ...)
    ...
    setup.release()       # the run is over: its folder may be pruned in its turn
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .elastic_plan import ElasticBounds
from .launcher import Launcher
from .run_folders import RunFolder, new_run_folder, new_run_id
from ..rank.memory_cap import capped_environment
from ..runtime.settings import (TORCH_PLANE_VARIABLE, TRANSPORT_VARIABLE, torch_plane_choice,
                                transport_choice)
from ..wire.channel import PEER_TIMEOUT_VARIABLE, new_secret, peer_timeout_s


@dataclass(frozen=True)
class RunSetup:
    """A run (or pool) ready to start its ranks."""

    run_id: str
    folder: RunFolder  # its logs (and its timeline by default), held until `release`
    env: dict[str, str]  # what every rank gets in its environment
    timeline_path: str | None  # where its trace goes; None: it records none
    secret: bytes  # what every connection of its ranks proves

    @property
    def log_dir(self) -> str:
        return str(self.folder)

    def release(self) -> None:
        self.folder.release()


def prepare_run(np: int, launcher: Launcher, *, env: dict[str, str], use_gpu: bool,
                timeline_path: str | None, bounds: ElasticBounds | None = None,
                memory_per_rank: str | None = None, pool: bool = False) -> RunSetup:
    """Check what can be checked before anything exists (a refused run leaves no trace),
    then name the run and make its folder. `timeline_path=""`: a timeline kept with the
    run's logs (a pool's cells each add '-cell-N.json' to its path)."""
    launcher.check(np)
    if bounds is not None:  # a launcher that cannot replace ranks refuses the run
        launcher.check_elastic(np, bounds.max_np)
    env = ranks_environment(env, use_gpu)
    if memory_per_rank is not None:
        env.update(capped_environment(memory_per_rank, on_spark=not launcher.caps_memory))
    if use_gpu:
        launcher.check_gpus(np)
    run_id = new_run_id(pool)
    folder = new_run_folder(run_id)
    if timeline_path == "":  # asked for, no path given: keep it with the run's logs
        timeline_path = os.path.join(folder, "timeline" if pool else "timeline.json")
    return RunSetup(run_id, folder, env, timeline_path, new_secret())


def ranks_environment(env: dict[str, str], use_gpu: bool) -> dict[str, str]:
    """What every rank of a run (or pool) gets in its environment on top of the user's
    `env`: the transports and peer timeout, checked here rather than first on every rank, and
    passed on, since Spark executors do not inherit the notebook's environment."""
    transport = transport_choice(env.get(TRANSPORT_VARIABLE, os.environ.get(TRANSPORT_VARIABLE)))
    peer_timeout_s()  # a bad DDL_MAGIC_PEER_TIMEOUT is refused before anything starts
    torch_plane = torch_plane_choice(env.get(TORCH_PLANE_VARIABLE, os.environ.get(TORCH_PLANE_VARIABLE)))
    env = {**env, TRANSPORT_VARIABLE: transport, TORCH_PLANE_VARIABLE: torch_plane}
    if PEER_TIMEOUT_VARIABLE in os.environ:
        env.setdefault(PEER_TIMEOUT_VARIABLE, os.environ[PEER_TIMEOUT_VARIABLE])
    if use_gpu:
        env["DDL_MAGIC_GPU"] = "1"
    return env
