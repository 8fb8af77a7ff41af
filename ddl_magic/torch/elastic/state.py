"""What an elastic run keeps in step across ranks and rolls back after a failure.

A state has three verbs (Horovod's):

- `commit()`: remember the current values, in this process's memory (no storage round
  trip), then check whether the driver announced a host change;
- `restore()`: go back to the last commit (after a failed collective, some ranks may
  have applied a step that others did not);
- `sync()`: give every rank rank 0's values (a rank that joined has none yet), which
  then are every rank's commit.

`TorchState` commits a model's and an optimizer's tensors by copying them into clones
made at the first commit: a commit allocates no tensor memory after the first, unless
the tensors' shapes change. The clones live where the tensors do (on the GPU for a model
on a GPU, as Horovod's deep copies do): a commit is a device-to-device copy.
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable
from typing import Any

import torch

from ..functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..ops import Max, allreduce_, rank, size
from .exceptions import HostsUpdatedInterrupt, HostUpdateResult
from .sampler import ElasticSampler


class State:
    """The base of every elastic state: commits, host-update checks and reset callbacks.

    Subclasses say how their values are saved, restored and synced (`save`, `restore`,
    `sync`); `reset` is called after the world was re-formed, before the callbacks.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commit_count = 0  # this process's commits: a reset reports which one it resumed from
        # (last agreed notice, newest notice seen, removed?, added?), max-allreduced by
        # check_host_updates: one tensor for the life of the state.
        self._host_check = torch.zeros(4, dtype=torch.float64)

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Run `callbacks` after every reset, in order, once the new world is formed and
        before the state is synced (to rescale the learning rate to `hvd.size()`, say).

        >>> state.register_reset_callbacks([lambda: set_lr(base_lr * hvd.size())])
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self, formed_at: float = 0.0) -> None:
        """What the elastic loop calls once the world is re-formed. The driver formed it at
        `formed_at` (its clock, as notices are stamped) knowing of every host change until
        then: older notices, even those that arrive after it, are old news. Newer ones stay
        queued for the next check (a replacement ready just after the world formed)."""
        self._last_updated_timestamp = max(self._last_updated_timestamp, formed_at)
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, result: HostUpdateResult) -> None:
        """A notice from the driver (any thread): seen at the next check."""
        self._host_messages.put((timestamp, result))

    def commit(self) -> None:
        """Remember the current state in memory, then `check_host_updates()`.

        Every rank commits at the same point of the loop (the check is a collective).
        Commit as often as a failure's lost work is worth the copy.
        """
        self.save()
        self.commit_count += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank if any rank has heard of a host
        change since the last check (a collective: every rank calls it at the same point).
        """
        newest, update = self._last_updated_timestamp, HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get_nowait()
            if timestamp > self._last_updated_timestamp:
                newest = max(newest, timestamp)
                update |= result
        # Ranks agree by a max over all of them, not by trusting rank 0: a notice may reach
        # some ranks before others, and a rank that just joined knows no earlier notice.
        agreed = self._host_check
        agreed[0], agreed[1] = self._last_updated_timestamp, newest
        agreed[2] = float(bool(update & HostUpdateResult.removed))
        agreed[3] = float(bool(update & HostUpdateResult.added))
        if size() > 1:
            allreduce_(agreed, op=Max, name="elastic.check_host_updates")
        previous, newest, removed, added = agreed.tolist()
        self._last_updated_timestamp = newest
        if newest > previous:
            raise HostsUpdatedInterrupt(skip_sync=bool(removed) and not added)

    def save(self) -> None:
        """Copy the current values to this process's memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Back to the values of the last commit."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every rank rank 0's current values, and make them every rank's commit."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust to the new world, before the callbacks and the sync (nothing by default)."""


class ObjectState(State):
    """Plain Python values, each given as a keyword argument and kept as an attribute.

    A commit keeps references to the values, as Horovod's does: assign new values
    (`state.epoch += 1`) rather than change an object in place.

    >>> state = hvd.elastic.ObjectState(epoch=0, batch=0)
    >>> state.epoch += 1; state.commit()
    """

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = rank, **kwargs: Any):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        for name in self._saved_state:
            self._saved_state[name] = getattr(self, name)

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            current = {name: getattr(self, name) for name in self._saved_state}
            self._saved_state = self._bcast_object(current)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class TorchState(ObjectState):
    """A PyTorch training's state: a model, an optimizer, an `ElasticSampler` (as
    `sampler=`, or any keyword whose value is one), anything with `state_dict` and
    `load_state_dict` (a `ddl_magic.data` loader: its position), and plain values.

    Each keyword whose value is a `torch.nn.Module`, a `torch.optim.Optimizer` or an
    `ElasticSampler` is committed by a handler that copies its tensors, one with
    `state_dict`/`load_state_dict` by its state dict; the others are plain values, as in
    `ObjectState`. Assigning a new model or optimizer to the attribute
    (`state.model = other`) commits it.

    >>> state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any):
        kwargs.update(model=model, optimizer=optimizer)
        handlers = {name: _handler_for(value) for name, value in kwargs.items()}
        self._handlers = {name: handler for name, handler in handlers.items() if handler}
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        plain = {name: value for name, value in kwargs.items() if name not in self._handlers}
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
            handler.save()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


class _Handler:
    """How one kind of value is committed, restored and synced."""

    def __init__(self, value: Any):
        self.value = value
        self.save()

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class _TensorCopies:
    """Clones of a list of tensors, made once and refreshed in place: `copy_from` allocates
    only when the tensors' shapes, dtypes or devices change."""

    def __init__(self):
        self.saved: list[torch.Tensor] = []

    def copy_from(self, tensors: list[torch.Tensor]) -> None:
        if not _same_layout(self.saved, tensors):
            self.saved = [torch.empty_like(t, memory_format=torch.preserve_format)
                          for t in tensors]
        if tensors:  # state_dict()'s tensors need no grad: one torch call copies them all
            with torch.no_grad():
                torch._foreach_copy_(self.saved, tensors)


def _same_layout(saved: list[torch.Tensor], tensors: list[torch.Tensor]) -> bool:
    return len(saved) == len(tensors) and all(
        s.shape == t.shape and s.dtype == t.dtype and s.device == t.device
        and s.stride() == t.stride() for s, t in zip(saved, tensors))


class _ModelHandler(_Handler):
    """A module's `state_dict()`: parameters and buffers."""

    def __init__(self, model: torch.nn.Module):
        self._names: list[str] = []
        self._copies = _TensorCopies()
        self._others: dict[str, Any] = {}  # a module's extra state that is not a tensor
        super().__init__(model)

    def save(self) -> None:
        live = self.value.state_dict()
        self._names = [name for name, value in live.items() if isinstance(value, torch.Tensor)]
        self._copies.copy_from([live[name] for name in self._names])
        self._others = {name: copy.deepcopy(value) for name, value in live.items()
                        if not isinstance(value, torch.Tensor)}

    def restore(self) -> None:
        saved = dict(zip(self._names, self._copies.saved))
        self.value.load_state_dict({**saved, **copy.deepcopy(self._others)})  # copies in place

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler):
    """An optimizer's `state_dict()`: its per-parameter state (Adam's moments and step
    counts) and its parameter groups' hyperparameters."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if hasattr(optimizer, "consolidate_state_dict"):
            raise NotImplementedError(
                "TorchState: an optimizer with sharded state (shard_optimizer_state=True) "
                "cannot be elastic: a rank that is lost takes its share of the state with it. "
                "Wrap the optimizer without shard_optimizer_state for an elastic run")
        self._keys: list[tuple[int, str]] = []
        self._copies = _TensorCopies()
        self._others: dict[tuple[int, str], Any] = {}  # state that is not a tensor (LBFGS's)
        self._hyperparameters: list[dict] = []  # each parameter group's, without its params
        super().__init__(optimizer)

    def save(self) -> None:
        live = self.value.state_dict()
        state = live["state"]
        keys = [(index, key) for index, values in state.items() for key in values]
        self._keys = [(index, key) for index, key in keys
                      if isinstance(state[index][key], torch.Tensor)]
        self._copies.copy_from([state[index][key] for index, key in self._keys])
        self._others = {(index, key): copy.deepcopy(state[index][key]) for index, key in keys
                        if not isinstance(state[index][key], torch.Tensor)}
        self._hyperparameters = [{key: copy.deepcopy(value) for key, value in group.items()
                                  if key != "params"} for group in live["param_groups"]]

    def restore(self) -> None:
        # load_state_dict keeps the tensors it is given when their dtype and device already
        # fit: it gets clones, or training would write into the commit.
        state: dict[int, dict[str, Any]] = {}
        for (index, key), saved in zip(self._keys, self._copies.saved):
            state.setdefault(index, {})[key] = saved.clone()
        for (index, key), value in self._others.items():
            state.setdefault(index, {})[key] = copy.deepcopy(value)
        groups = [{**copy.deepcopy(saved), "params": live["params"]} for saved, live
                  in zip(self._hyperparameters, self.value.state_dict()["param_groups"])]
        self.value.load_state_dict({"state": state, "param_groups": groups})

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def save(self) -> None:
        self._point = self.value.commit_point()

    def restore(self) -> None:
        self.value.return_to(self._point)

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(),
                                                    name="elastic.sampler"))


class _StatefulHandler(_Handler):
    """Anything else with torch's `Stateful` protocol (`state_dict`, `load_state_dict`), a
    data loader's position say (`ddl_magic.data`): its `state_dict()` is committed, and
    synced from rank 0 (a loader's position is the same on every rank)."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(),
                                                    name="elastic.stateful"))


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
]


def _handler_for(value: Any) -> _Handler | None:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return _StatefulHandler(value)
    return None
