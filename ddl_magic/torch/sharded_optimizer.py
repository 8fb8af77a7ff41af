"""Sharded optimizer state (ZeRO stage 1): each rank keeps the state of its share of the
parameters only.

Adam keeps two moments per parameter: for a model of P float32 parameters, 8P bytes on
every rank, twice the model itself. With ``hvd.DistributedOptimizer(optimizer,
shard_optimizer_state=True)`` the parameters are shared out among the N ranks; each rank's
optimizer holds and steps only its own share, and a step is

1. **reduce-scatter the gradients**: each rank receives the averaged gradients of its own
   share and nothing else (the scatter-reduce half of a ring allreduce);
2. **step**: the wrapped optimizer updates this rank's share, and has state for it only;
3. **allgather the parameters**: every rank receives every updated share (the other half).

Together that is the bytes of one allreduce, and each rank does 1/N of the optimizer's work.

How the parameters are shared out depends on the optimizer:

- torch.optim's elementwise optimizers (SGD, Adam, AdamW, RMSprop, ...: `ELEMENTWISE`) update
  each element from its own gradient and state alone, so the parameters, laid end to end,
  are cut into N equal ranges, as DeepSpeed's ZeRO cuts them: exactly 1/N of the state per
  rank. A parameter cut by a range boundary is stepped as two *pieces*, leaf tensors that
  view its memory, one on each rank;
- any other optimizer may look at a whole tensor at once (Adafactor factors a matrix by rows
  and columns, Muon orthogonalises it), so parameters are shared out whole, in runs of about
  equal size, as torch's `ZeroRedundancyOptimizer` does: 1/N to within one parameter.

Between steps only this rank's share has averaged gradients; other parameters' `.grad` is
None (clip with `optimizer.clip_grad_norm_`, which sees every rank's share). A checkpoint is
whole: `consolidate_state_dict(to=0)` gathers every share to one rank, whose `state_dict()`
is then exactly the unsharded optimizer's, loadable into either.
"""

from __future__ import annotations

import itertools
import math

import torch

from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from ..runtime.reduce_ops import ReduceOp
from ..runtime.planes.ring import chunk_bounds
from .compression import Compressor
from .functions import allgather_object, broadcast_object
from .ops import (allgather_into_async, allreduce, rank, reducescatter_parts_async_, size,
                  synchronize)
from .optimizer import _DistributedOptimizer

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
               torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD)
"""Optimizers whose update of an element reads only that element's gradient and state."""


def share_out(params: list[torch.Tensor], ranks: int) -> list[int]:
    """The rank owning each parameter, for optimizers that must see whole parameters: runs of
    consecutive parameters of about equal size. A parameter goes to the rank whose 1/N of all
    the elements its middle element falls in.

    >>> share_out([torch.empty(10), torch.empty(10), torch.empty(5), torch.empty(15)], 2)
    [0, 0, 1, 1]
    """
    total = sum(p.numel() for p in params) or 1
    owners, start = [], 0
    for param in params:
        middle = start + param.numel() / 2
        owners.append(min(ranks - 1, int(middle * ranks / total)))
        start += param.numel()
    return owners


def whole_parameter_ranges(params: list[torch.Tensor], ranks: int) -> list[tuple[int, int]]:
    """Each rank's range of the parameters laid end to end, cut only between parameters."""
    owners, ranges, start = share_out(params, ranks), [], 0
    for r in range(ranks):
        numel = sum(p.numel() for p, owner in zip(params, owners) if owner == r)
        ranges.append((start, start + numel))
        start += numel
    return ranges


class _Piece:
    """The part of one parameter in this rank's range: the parameter itself when the range
    holds all of it, else a leaf tensor viewing elements `[start, end)` of it."""

    def __init__(self, param: torch.Tensor, index: int, start: int, end: int):
        self.param, self.index, self.start, self.end = param, index, start, end
        self.whole = start == 0 and end == param.numel()
        if self.whole:
            self.leaf = param
        else:
            if not param.is_contiguous():
                raise ValueError("DistributedOptimizer(shard_optimizer_state=True) cuts parameters "
                                 "at shard boundaries, which needs contiguous parameters; make "
                                 "them contiguous before building the optimizer")
            self.leaf = torch.nn.Parameter(param.detach().view(-1)[start:end])


class _Share:
    """The trainable parameters of one dtype and device, laid end to end, and this rank's range.

    Their gradients travel as one flat buffer of which rank r reduces `numels[r]` elements,
    its range; the updated parameters travel back the same way. Both buffers are kept from
    step to step: a fresh one would cost a page fault per 4 KiB every step.
    """

    def __init__(self, name: str, params: list[torch.Tensor], indices: list[int],
                 ranges: list[tuple[int, int]], me: int):
        self.name = name
        self.params = params
        self.ranges = ranges
        self.numels = [end - start for start, end in ranges]
        mine_start, mine_end = ranges[me]
        self.pieces, offset = [], 0
        for param, index in zip(params, indices):
            start, end = max(mine_start - offset, 0), min(mine_end - offset, param.numel())
            if start < end:
                self.pieces.append(_Piece(param, index, start, end))
            offset += param.numel()
        self.whole_here = {id(piece.param) for piece in self.pieces if piece.whole}
        self.offsets = dict(zip(map(id, params),
                                itertools.accumulate([p.numel() for p in params], initial=0)))
        total = sum(self.numels)
        self.gradients = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
        self.gathered = torch.empty(total, dtype=params[0].dtype)  # collectives gather on the host
        self.gradient_slots = list(self.gradients.split([p.numel() for p in params]))

    def flat_gradients(self) -> torch.Tensor:
        """Every parameter's gradient in the gradient buffer, zeros where a parameter has none."""
        dense = [(p.grad.to_dense() if p.grad.is_sparse else p.grad).reshape(-1)
                 for p in self.params if p.grad is not None]
        slots = [slot for p, slot in zip(self.params, self.gradient_slots) if p.grad is not None]
        if len(slots) < len(self.params):
            self.gradients.zero_()
        torch._foreach_copy_(slots, dense)
        return self.gradients

    def parts_of(self, param: torch.Tensor) -> list[tuple[int, int, int]]:
        """(rank, start, end): which elements of `param`, flattened, each rank holds."""
        offset = self.offsets[id(param)]
        parts = [(r, max(a, offset) - offset, min(b, offset + param.numel()) - offset)
                 for r, (a, b) in enumerate(self.ranges)]
        return [(r, start, end) for r, start, end in parts if start < end]

    def flat_mine(self) -> torch.Tensor:
        """This rank's range of the parameters, as one buffer."""
        if not self.pieces:
            return torch.empty(0, dtype=self.params[0].dtype, device=self.params[0].device)
        return torch.cat([piece.leaf.detach().reshape(-1) for piece in self.pieces])


class _ShardedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class by `DistributedOptimizer(shard_optimizer_state=True)`.

    `param_groups` holds this rank's pieces only (and any parameter that needs no gradient),
    so the wrapped class's `step()` updates, and creates state for, this rank's share alone.
    """

    def __init__(self, param_groups, names: dict[torch.Tensor, str], elementwise: bool,
                 compression: type[Compressor], op: ReduceOp, prescale: float, postscale: float,
                 sparse_as_dense: bool):
        self._every_group = [list(group["params"]) for group in param_groups]
        every = [p for params in self._every_group for p in params]
        kinds: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for index, param in enumerate(every):
            if param.requires_grad:
                kinds.setdefault((param.dtype, param.device), []).append((index, param))
        self._shares = []
        for members in kinds.values():
            params = [param for _, param in members]
            ranges = (chunk_bounds(sum(p.numel() for p in params), size()) if elementwise
                      else whole_parameter_ranges(params, size()))
            self._shares.append(_Share(f"{names[params[0]]}+{len(params) - 1}", params,
                                       [index for index, _ in members], ranges, rank()))
        self._pieces = [piece for share in self._shares for piece in share.pieces]
        piece_of = {id(piece.param): piece for piece in self._pieces}
        local_groups = []
        for group in param_groups:
            keep = [id(p) in piece_of or not p.requires_grad for p in group["params"]]
            leaves = [piece_of[id(p)].leaf if id(p) in piece_of else p for p in group["params"]]
            local_groups.append(_keeping(group, keep, leaves))
        super(self.__class__, self).__init__(local_groups)
        self._built = True
        self._names = names
        self._elementwise = elementwise
        self._compression = compression
        self._op, self._prescale, self._postscale = op, prescale, postscale
        self._sparse_as_dense = sparse_as_dense
        self._synchronized = False
        self._skip_synchronize = False
        self._consolidated: dict | None = None

    # ---- a step ------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Reduce-scatter the gradients: this rank's pieces get the averages, every parameter
        not wholly this rank's gets None (its averages live on the ranks that own it)."""
        handles = []
        for share in self._shares:
            self._check_dense(share)
            wire, ctx = self._compression.compress(share.flat_gradients())
            handles.append((reducescatter_parts_async_(
                wire, tuple(share.numels), f"zero.gradients.{share.name}", self._op,
                self._prescale, self._postscale, "DistributedOptimizer"), ctx))
        for share, (handle, ctx) in zip(self._shares, handles):
            averaged = self._compression.decompress(synchronize(handle), ctx)
            sizes = [piece.end - piece.start for piece in share.pieces]
            for piece, gradient in zip(share.pieces, averaged.split(sizes)):
                sparse = piece.param.grad is not None and piece.param.grad.is_sparse
                piece.leaf.grad = gradient.view_as(piece.leaf)
                if sparse and piece.whole:  # as it came: SparseAdam takes only sparse gradients
                    piece.leaf.grad = piece.leaf.grad.to_sparse()
            for param in share.params:
                if id(param) not in share.whole_here:
                    param.grad = None
        self._synchronized = True

    def _check_dense(self, share: _Share) -> None:
        for param in share.params:
            if param.grad is not None and param.grad.is_sparse and not self._sparse_as_dense:
                raise ValueError("DistributedOptimizer(shard_optimizer_state=True) reduce-scatters "
                                 "dense gradients; for nn.Embedding(sparse=True) and other "
                                 "sparse gradients pass sparse_as_dense=True as well")

    # `optimizer.synchronize(); optimizer.clip_grad_norm_(...); with optimizer.skip_synchronize(): ...`
    skip_synchronize = _DistributedOptimizer.skip_synchronize

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DistributedOptimizer(shard_optimizer_state=True): step(closure) "
                             "would compute gradients that no rank averages; call backward() "
                             "before step() instead")
        if not (self._skip_synchronize and self._synchronized):
            self.synchronize()
        self._synchronized = False
        loss = super(self.__class__, self).step()
        self._gather_parameters()
        return loss

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        """Every rank's updated range to every rank (the allgather half of the step)."""
        handles = [allgather_into_async(share.flat_mine(), share.gathered,
                                        name=f"zero.parameters.{share.name}")
                   for share in self._shares]
        for share, handle in zip(self._shares, handles):
            every = synchronize(handle).split([p.numel() for p in share.params])
            arrived = [(p, flat.view_as(p)) for p, flat in zip(share.params, every)
                       if id(p) not in share.whole_here]
            if arrived and share.gathered.device == arrived[0][0].device:
                torch._foreach_copy_([p for p, _ in arrived], [flat for _, flat in arrived])
            else:
                for param, flat in arrived:
                    param.copy_(flat)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every parameter's gradient and every piece's, not only this rank's share."""
        for tensor in [p for params in self._every_group for p in params] + \
                [piece.leaf for piece in self._pieces if not piece.whole]:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            else:
                tensor.grad.detach_().requires_grad_(False)
                tensor.grad.zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over every rank's share: call it between
        `synchronize()` and `step()` (inside `skip_synchronize()`); returns the total norm."""
        if not self._synchronized:
            self.synchronize()
        grads = [piece.leaf.grad.detach() for piece in self._pieces if piece.leaf.grad is not None]
        norm_type = float(norm_type)
        if math.isinf(norm_type):
            local = max((g.abs().max().double() for g in grads), default=torch.tensor(0.0))
            total = allreduce(local.reshape(1).double(), op=ReduceOp.MAX, name="zero.grad_norm")[0]
        else:
            local = sum((g.double().norm(norm_type) ** norm_type for g in grads), torch.tensor(0.0))
            total = allreduce(local.reshape(1).double(), op=ReduceOp.SUM,
                              name="zero.grad_norm")[0] ** (1.0 / norm_type)
        scale = max_norm / (float(total) + 1e-6)
        if scale < 1.0:
            torch._foreach_mul_(grads, scale)
        return total

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_built", False):  # the wrapped class's __init__ adds its groups
            return super(self.__class__, self).add_param_group(param_group)
        raise NotImplementedError("DistributedOptimizer(shard_optimizer_state=True) shares out "
                                  "the parameters it was built with; add every parameter group "
                                  "to the optimizer before wrapping it")

    def broadcast_hyperparameters(self, root_rank: int) -> None:
        """What `hvd.broadcast_optimizer_state` does for a sharded optimizer: each rank's state
        is its own share, so only `root_rank`'s hyperparameters (learning rate, betas, ...) travel."""
        options = [{k: v for k, v in group.items() if k not in ("params", "param_names")}
                   for group in self.param_groups]
        chosen = broadcast_object(options, root_rank, name="zero.hyperparameters")
        for group, options in zip(self.param_groups, chosen):
            group.update(options)

    # ---- checkpoints ---------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's share of the state on rank `to` (every rank must call this),
        whose `state_dict()` then returns the whole, as the unsharded optimizer's would."""
        local = super(self.__class__, self).state_dict()
        leaves = [p for group in self.param_groups for p in group["params"]]
        piece_of = {id(piece.leaf): piece for piece in self._pieces}
        mine = [(piece_of[id(leaves[i])].index, piece_of[id(leaves[i])].start, state)
                for i, state in local["state"].items() if id(leaves[i]) in piece_of]
        shares = allgather_object(mine, name="zero.consolidate_state_dict")
        if rank() != to:
            self._consolidated = None
            return
        every = [p for params in self._every_group for p in params]
        parts: dict[int, list[tuple[int, dict]]] = {}
        for index, start, state in (entry for share in shares for entry in share):
            parts.setdefault(index, []).append((start, state))
        state = {index: _joined([s for _, s in sorted(pieces, key=lambda p: p[0])], every[index])
                 for index, pieces in sorted(parts.items())}
        first = 0
        groups = []
        for group, params in zip(local["param_groups"], self._every_group):
            options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append(dict(options, params=list(range(first, first + len(params)))))
            first += len(params)
        self._consolidated = {"state": state, "param_groups": groups}

    def state_dict(self) -> dict:
        if self._consolidated is None:
            raise RuntimeError("a sharded optimizer's state lives on every rank: call "
                               "optimizer.consolidate_state_dict(to=0) on every rank first, "
                               "then optimizer.state_dict() on rank 0")
        consolidated, self._consolidated = self._consolidated, None
        return consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state dict (this optimizer's consolidated one, or the unsharded
        optimizer's): each rank keeps its own share."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(params) for params in self._every_group]:
            raise ValueError("load_state_dict: the state dict's parameter groups do not match "
                             "this optimizer's (a different model, or groups in another order)")
        piece_of = {id(piece.param): piece for piece in self._pieces}
        state, local_groups, local_index = {}, [], 0
        for group, params in zip(groups, self._every_group):
            keep = [id(p) in piece_of or not p.requires_grad for p in params]
            indices = []
            for saved, param, kept in zip(group["params"], params, keep):
                if not kept:
                    continue
                if saved in state_dict["state"]:
                    piece = piece_of.get(id(param))
                    state[local_index] = (state_dict["state"][saved] if piece is None
                                          else _cut(state_dict["state"][saved], piece))
                indices.append(local_index)
                local_index += 1
            local_groups.append(_keeping(group, keep, indices, kept_only=True))
        super(self.__class__, self).load_state_dict({"state": state, "param_groups": local_groups})


    # ---- checkpoints without gathering: torch.distributed.checkpoint -------------------------

    def sharded_state_dict(self) -> dict:
        """This rank's share of the state, for `torch.distributed.checkpoint` (DCP): every rank
        writes its own share, nothing is gathered on one rank, and a checkpoint saved at one
        world size loads at another (each rank reads the parts that overlap its new share).

            >>> state = {"model": model.state_dict(), "optimizer": optimizer.sharded_state_dict()}
            >>> dcp.save(state, checkpoint_id=path)                 # every rank
            >>> dcp.load(state, checkpoint_id=path)                 # every rank, any world size
            >>> optimizer.load_sharded_state_dict(state["optimizer"])

        State is keyed by parameter name (`named_parameters` of the DistributedOptimizer). An
        elementwise optimizer's per-element state (Adam's moments) is each parameter's,
        flattened, of which this rank holds its range: DCP sees one tensor in parts (a
        `ShardedTensor`). Other state (a step count, a whole parameter's factors) is whole. An
        optimizer that has not stepped yet gets its state first, by a step of zero gradients
        at learning rate 0 on this rank's share, as torch's `get_state_dict` does.
        DCP needs torch.distributed: `dist.init_process_group("ddl")` on every rank first.
        """
        if not self.state:
            self._create_state()
        state = {}
        for share in self._shares:
            for piece in share.pieces:
                state[self._names[piece.param]] = {
                    key: self._checkpointed(share, piece, value)
                    for key, value in self.state[piece.leaf].items()}
        return {"state": state, "param_groups": [
            {**{k: v for k, v in group.items() if k not in ("params", "param_names")},
             "params": [self._names[p] for p in params]}
            for group, params in zip(self.param_groups, self._every_group)]}

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Take what `dcp.load` read into a `sharded_state_dict()`: tensors were read in place,
        the rest (scalars, the hyperparameters) is set here."""
        for piece in self._pieces:
            saved, state = state_dict["state"][self._names[piece.param]], self.state[piece.leaf]
            for key, value in saved.items():
                if isinstance(value, ShardedTensor):
                    value = value.local_shards()[0].tensor
                if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    if value.data_ptr() != state[key].data_ptr():
                        state[key].copy_(value.view_as(state[key]))
                else:
                    state[key] = value
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k not in ("params", "param_names")})

    def _checkpointed(self, share: _Share, piece: _Piece, value):
        """A state value as DCP should see it (see `sharded_state_dict`)."""
        if not (self._elementwise and isinstance(value, torch.Tensor) and value.dim() > 0):
            return value
        flat = value.view(-1)  # a view: DCP reads into the state itself
        if piece.whole:
            return flat
        shards = [ShardMetadata([start], [end - start], f"rank:{r}/{flat.device}")
                  for r, start, end in share.parts_of(piece.param)]
        properties = TensorProperties(dtype=flat.dtype, layout=flat.layout)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(flat, ShardMetadata([piece.start], [flat.numel()], f"rank:{rank()}/{flat.device}"))],
            ShardedTensorMetadata(shards, torch.Size([piece.param.numel()]), properties))

    @torch.no_grad()
    def _create_state(self) -> None:
        """The state a first step creates, with nothing changed: this rank's share steps once
        on zero gradients at learning rate 0 (no collective: it is this rank's alone)."""
        rates = [group.get("lr") for group in self.param_groups]
        for group in self.param_groups:
            if "lr" in group:
                group["lr"] = 0.0 * group["lr"]  # the same type: a tensor lr stays a tensor
        leaves = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        for leaf in leaves:
            leaf.grad = torch.zeros_like(leaf)
        try:
            super(self.__class__, self).step()
        finally:
            for group, rate in zip(self.param_groups, rates):
                if rate is not None:
                    group["lr"] = rate
            for leaf in leaves:
                leaf.grad = None


def _joined(states: list[dict], param: torch.Tensor) -> dict:
    """One parameter's state from its pieces' states, in order: elementwise tensors are
    joined and shaped like the parameter; scalars (a step count) are the same in every piece."""
    if len(states) == 1 and not _is_cut(states[0], param):
        return states[0]
    return {key: torch.cat([s[key].reshape(-1) for s in states]).view_as(param)
            if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for key, value in states[0].items()}


def _is_cut(state: dict, param: torch.Tensor) -> bool:
    return any(isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != param.numel()
               for v in state.values())


def _cut(state: dict, piece: _Piece) -> dict:
    """A parameter's saved state, as its piece on this rank needs it."""
    if piece.whole:
        return state
    return {key: value.reshape(-1)[piece.start:piece.end].clone()
            if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for key, value in state.items()}


def _keeping(group: dict, keep: list[bool], params: list, kept_only: bool = False) -> dict:
    """`group` with the kept ones of `params` (and of its `param_names`, where it has them);
    `kept_only`: `params` lists the kept ones already."""
    kept = dict(group, params=list(params) if kept_only else [p for p, k in zip(params, keep) if k])
    if "param_names" in group:
        kept["param_names"] = [n for n, k in zip(group["param_names"], keep) if k]
    return kept


def sharded(optimizer: torch.optim.Optimizer, names: dict[torch.Tensor, str],
            compression: type[Compressor], op: ReduceOp, prescale: float, postscale: float,
            sparse_as_dense: bool) -> torch.optim.Optimizer:
    """`optimizer` rebuilt as a sharded one of the same class (what `DistributedOptimizer` returns)."""
    if optimizer.state:
        raise ValueError("DistributedOptimizer(shard_optimizer_state=True) needs an optimizer that "
                         "has not stepped yet: wrap it first, then load a checkpoint with "
                         "load_state_dict()")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_ShardedOptimizer.__dict__))
    return cls(optimizer.param_groups, names, isinstance(optimizer, ELEMENTWISE), compression,
               op, prescale, postscale, sparse_as_dense)
