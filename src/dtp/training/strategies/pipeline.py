"""Pipeline parallel: one runner executes any schedule's action list (:mod:`dtp.schedules`).

Rank ``r`` of the ``pp`` axis holds the global stages the schedule's stage map gives it
(:class:`dtp.schedules.Schedule`: ``r, r+p, …``, one per virtual chunk, or under a V
schedule ``r`` and ``2p-1-r``; layers per stage: :func:`dtp.layouts.pipeline.assign`),
i.e. the parameters those stages' layers read, laid out by the rest of the layout on the
*stage mesh* (the mesh without ``pp``: dp, cp, tp go on as everywhere else). The
parameters of other stages are ``None`` in its tree.

For each action of its list, in order:

* ``F`` (chunk c, microbatch i): the stage's input is the microbatch (first stage) or
  the activation received from the previous stage; run the stage's layers; post the
  output to the next stage (``dtp.comm.Peer.send``, asynchronous) — or, on the last stage,
  keep the loss;
* ``B``: backward of that microbatch through the stage with the gradient received from
  the next stage (the loss weighted 1/m on the last stage); post the input's gradient to
  the previous stage; add the parameters' gradients to the step's accumulators;
* ``I`` / ``W`` (zero-bubble): the same backward split — ``I`` computes and posts only
  the input's gradient and keeps the gradients at the graph's nodes that lead to the
  weights, ``W`` starts there for the parameters' gradients later, where the schedule
  has a bubble to fill (:mod:`.pipeline_split`: ``I + W = B`` in FLOPs);
* ``F&B`` (DualPipeV's :class:`dtp.schedules.Pair`): one microbatch's ``F`` and another's
  ``B`` back to back, both inputs' receives posted before the action ahead of it
  computes, the forward's output posted before the backward computes (its transfer is
  in flight meanwhile).

Under ``layouts.expert(ep_overlap=True)`` (1f1b, interleaved, dualpipev) the plan's pairs
(:func:`dtp.schedules.lane_pairs`: DualPipeV's F&B, and adjacent F / B actions of other
microbatches where that cannot deadlock) run side by side on two cooperative lanes
(:mod:`dtp.ops.lanes`), one's expert all-to-alls under the other's compute, both inputs
received before either starts.

Receives are posted three items ahead (:mod:`.pipeline_plan`: a gloo receive posted
before the peer's send costs tens of µs, after it milliseconds when the peer computes);
sends never block. What travels is the model's carry: one tensor, or a
tree (an MoE model's hidden state and its blocks' aux losses and statistics), one
message per leaf; gradients come back for the leaves that required one
(:mod:`.pipeline_wire`). Microbatch 0's messages carry small headers (global shape,
dtype, placements, the tree's structure) so stages need not know each other's shapes. With tensor parallel and
an activation replicated over ``tp``, each tp rank sends only its 1/t of the sequence and
the receiver all-gathers it over ``tp`` (Megatron's scatter/gather optimisation; with
sequence parallel the residual already is split, so nothing extra moves).

``TrainState.buffers`` (replicated on the whole mesh) are laid over each stage's
parameters on the stage mesh; with a tree carry the head's aux goes to every pp rank
after the schedule, so the buffers' update is the same everywhere.

After the schedule: tied parameters (the embedding the first and the last stage both
read) have their gradients summed between those two ranks; then gradients are reduced
over dp as in :mod:`.replicated`, and the gradient norm sums over all stages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...core import comm
from ... import schedules
from ...core._rules import accum_dtype
from ...layouts import Layout, use_layout
from ...layouts.pipeline import assign
from ...core.mesh.devices import axis_names, axis_sizes, coordinates, mesh_device, sub_mesh
from ..buffers import with_buffers
from ...core.compiled import retaining_graph
from ...models.sequential import Sequential
from ...ops import collective_matmul
from ..optim import global_norm, map_param_trees
from ...core.redistribute import reshard, value_of
from ...core.spec import P, spec_of, wrap_local
from ...ops import lanes
from . import ep_overlap, pipeline_split, pipeline_wire as wire, replicated
from .pipeline_plan import rank_steps, receive_of
from . import zero as zero_mod

__all__ = ["Context", "Run", "stage_mesh", "gather", "held"]

PyTree = Any
_PARTS = 1024  # message keys per (channel, microbatch): headers, the tree, one per leaf (pipeline_wire)


@dataclass(frozen=True)
class Context:
    """What the pipeline run needs from the step: the layout, the whole mesh, the model."""

    layout: Layout
    mesh: DeviceMesh
    model: Sequential
    microbatches: int
    zero: "zero_mod.ZeroState | None" = None  # the state's ZeRO part (stage 1/2 under each stage)
    buffers: PyTree = None  # TrainState.buffers (whole-mesh, replicated): every stage reads them all


def stage_mesh(mesh: DeviceMesh, axis: str) -> DeviceMesh | None:
    """The mesh without the pipeline axis; ``None`` when that is one device (``axis`` is
    the only axis of size > 1): a stage's tensors are then plain, as in a one-device run.

    ``dtp train --pp 2`` builds ``pp=2 × dp=1``: a stage mesh of one device whose
    DTensors would meet plain batches (``shard_batch`` keeps one device's tensors plain).
    """
    rest = tuple(a for a in axis_names(mesh) if a != axis)
    if not rest or math.prod(axis_sizes(mesh)[a] for a in rest) == 1:
        return None
    return sub_mesh(mesh, rest)


def _paths(tree: PyTree) -> list[str]:
    return [".".join(map(str, p)) for p in optree.tree_paths(tree)]


def _owned(path: str, prefixes: Sequence[str]) -> bool:
    return any(path == q or path.startswith(q + ".") for q in prefixes)


def held(model: Sequential, layout: Layout, mesh: DeviceMesh) -> Callable[[str], bool]:
    """Whether this pp rank holds the parameter at a leaf path: its stages (the
    schedule's stage-to-rank map, :func:`dtp.schedules.placement`) read it. What
    ``TrainState.from_hf`` reads, and what a step keeps of the state's parameters."""
    opts = layout.pipeline
    p, v = opts.degree(mesh), opts.virtual_stages
    ranges = assign(len(model), p, v, opts.layer_split)
    rank, placement = coordinates(mesh)[opts.axis], schedules.placement(opts.schedule)
    stages = [schedules.global_stage(c, rank, p, placement) for c in range(v)]
    owned = tuple(set().union(*(model.paths(*ranges[stage]) for stage in stages)))
    return lambda path: _owned(path, owned)


class _Arrived:
    """A receive already waited for (:meth:`Run._in_lanes`): ``wait()`` hands its result."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result


class Run:
    """One step of a pipeline schedule (a :class:`dtp.strategies.Scheduled`); with
    ``forward_only`` the evaluation's forwards (:meth:`evaluate`), no gradients."""

    grouped = False

    def __init__(self, params: PyTree, ctx: Context, *, forward_only: bool = False):
        self.ctx, opts = ctx, ctx.layout.pipeline
        self.axis, self.p, self.v = opts.axis, opts.degree(ctx.mesh), opts.virtual_stages
        self.rank = coordinates(ctx.mesh)[self.axis]
        self.m = ctx.microbatches
        self.smesh = stage_mesh(ctx.mesh, self.axis)
        self.n_stages = self.p * self.v
        self.forward_only = forward_only
        expert = ctx.layout.expert
        self._lanes = expert is not None and expert.ep_overlap and not forward_only  # ep_overlap: pairs on lanes
        # The schedule (under ep_overlap its lanes' plan) and this rank's walk of it
        # (receives to post ahead): cached per config.
        self.plan, self.steps = rank_steps(opts.schedule, self.p, self.v, ctx.microbatches, self.rank, forward_only,
                                        lanes=self._lanes)
        self.placement = self.plan.placement  # the stage-to-rank map: the schedule's
        # Zero bubble's I / W: async tp's entry rings must not route input gradients
        # through weight-only nodes (collective_matmul.split_backward).
        self.split = any(a.kind == "I" for item in self.plan[self.rank]
                         for a in ((item.forward, item.backward) if isinstance(item, schedules.Pair) else (item,)))
        model = ctx.model
        ranges = assign(len(model), self.p, self.v, opts.layer_split)
        # (global stage, first layer, stop) of this rank's chunks, chunk order
        stages = [schedules.global_stage(c, self.rank, self.p, self.placement) for c in range(self.v)]
        self.chunks = tuple((stage, *ranges[stage]) for stage in stages)
        # The embedding both ends read (tied weights): its gradient is summed between them.
        self.tied = tuple(sorted(set(model.paths(*ranges[0])) & set(model.paths(*ranges[-1]))))
        leaves, self.treedef = optree.tree_flatten(params, none_is_leaf=True)
        paths = _paths(optree.tree_unflatten(self.treedef, list(range(len(leaves)))))
        is_held = held(model, ctx.layout, ctx.mesh)  # what from_hf reads: one rule
        self.keep = [is_held(path) for path in paths]
        self.paths = paths
        local = [self._to_stage(x) if keep and x is not None else None for x, keep in zip(leaves, self.keep)]
        self.params_tree = optree.tree_unflatten(self.treedef, local)
        self.leaves = optree.tree_leaves(self.params_tree)  # the held parameters (the inner run's order)
        # Per chunk, the held leaves its layers read: what its backward differentiates (no
        # ZeRO). Asking autograd for the other chunks' leaves too (interleaved, V) added
        # inputs that are never reached and a None per leaf to every accumulation.
        held_paths = [path for path, x in zip(paths, local) if x is not None]
        self.own = tuple(tuple(k for k, path in enumerate(held_paths) if _owned(path, model.paths(first, stop)))
                         for _, first, stop in self.chunks)
        self.buffers = optree.tree_map(self._to_stage, ctx.buffers) if ctx.buffers else None
        zero_opts = None if self.smesh is None or forward_only else zero_mod.options(ctx.layout, self.smesh)
        self.zero = zero_opts is not None
        if self.zero:
            # ZeRO 1/2 under each stage: buckets of this stage's parameters over dp, made
            # in the first step (the state's ZeroState covers every parameter until then).
            z = ctx.zero if ctx.zero is not None and ctx.zero.plan is not None else \
                zero_mod.create(self.params_tree, zero_opts)
            if z.plan is None and ctx.zero is not None and ctx.zero.loaded_master is not None:
                # A checkpoint's master weights (bf16 parameters): this rank's stages' share,
                # cut into the buckets in step one — not restarted from the parameters.
                z = dataclasses.replace(z, loaded_master=self.mirror(ctx.zero.loaded_master))
            self.inner = zero_mod.Run(z, self.params_tree, self.m)
        else:
            # Mixed precision (the caller wraps this run): gradients accumulate in fp32.
            self.inner = replicated.Run(self.params_tree, self.m, accumulate=ctx.layout.precision is not None)
        self.grouped = self.inner.grouped
        # full leaf index (None included) -> index among the held leaves (the inner run's)
        self.held = {j: k for k, j in enumerate(j for j, x in enumerate(local) if x is not None)}
        self.saved: dict[tuple[int, int], tuple[Any, Any]] = {}  # (chunk, mb) -> (input, output)
        self.pending_w: dict[tuple[int, int], pipeline_split.WeightGrad] = {}
        self.recvs: dict[tuple[str, int, int], Any] = {}
        self.posted: set[tuple[str, int, int]] = set()  # every receive posted this step (taken or not)
        self.meta: dict[tuple[str, int], tuple] = {}  # (kind, stage) -> microbatch 0's headers: structure, leaves
        self.sends: list[comm.CommHandle] = []
        self.peers: dict[int, comm.Peer] = {}  # pp rank -> its Peer, made at the first message
        self.act_sends: dict[tuple[int, int], list[comm.CommHandle]] = {}  # (next stage, mb) -> carry sent
        self.losses: dict[int, float] = {}
        self.auxes: dict[int, Any] = {}

    # ---- placement
    def _to_stage(self, x: torch.Tensor) -> torch.Tensor:
        """A parameter (or optimizer state) of the whole mesh, replicated over pp, as the
        stage mesh's: the same local tensor, no communication."""
        if not isinstance(x, DTensor) or x.device_mesh is self.smesh:
            return x.detach().requires_grad_(x.requires_grad) if isinstance(x, DTensor) else x
        local = x.to_local().detach()
        if self.smesh is None:
            return local.requires_grad_(x.requires_grad)
        return wrap_local(local, self.smesh, spec_of(x), tuple(x.shape)).requires_grad_(x.requires_grad)

    # ---- the StepRun interface
    def params(self) -> PyTree:
        # ZeRO: a fresh read-only view per forward (its reads record use and find buckets);
        # the buffers (replicated everywhere, a bias per expert) laid over on the stage mesh.
        return with_buffers(self.inner.params() if self.zero else self.params_tree, self.buffers)

    def schedule(self, loss_fn: Callable, microbatches: list[Mapping[str, Any]]) -> tuple[float, Any]:
        """Run this rank's action list; returns the mean loss (on every rank) and aux: the
        last stage's, ``None`` elsewhere — on every rank when the model's carry is a tree
        (MoE: the buffers' update and ``metrics["aux"]`` need it everywhere; one small
        broadcast over pp, :func:`.pipeline_wire.share`)."""
        actions = self.plan[self.rank]
        self.mbs = microbatches
        with use_layout(self.ctx.layout, self.smesh) if self.smesh is not None else contextlib.nullcontext(), \
                collective_matmul.split_backward() if self.split else contextlib.nullcontext(), \
                retaining_graph() if self.split else contextlib.nullcontext():  # recomputes too
            for item, step in zip(actions, self.steps):
                for recv in step.posts:  # a few items ahead (pipeline_plan)
                    self._post(*recv)
                if self._lanes and isinstance(item, schedules.Pair):  # every pair of the lanes' plan
                    self._in_lanes(item.forward, item.backward)
                    continue
                # A pair's backward input was posted with its forward's (items ahead); the
                # forward's send is in flight while the backward computes.
                for kind, chunk, i in step.runs:
                    getattr(self, f"_{kind}")(chunk, i)
        for handle in [*self.sends, *(h for hs in self.act_sends.values() for h in hs)]:
            handle.wait()
        self.sends.clear()
        self.act_sends.clear()
        self._sum_tied()
        aux = (self.auxes.get(0) if self.m == 1 else tuple(self.auxes[i] for i in sorted(self.auxes))
               ) if self.auxes else None
        if self.ctx.model.carry == "tree":
            aux = wire.share(aux, self._holds_last(), self.ctx.mesh, self.axis)
        return self._loss(), aux

    def evaluate(self, batches: list[Mapping[str, Any]]) -> list[tuple[float, Any]]:
        """Each batch's ``(loss, aux)`` (one microbatch each), forward only, on every rank:
        this rank's forwards in stage order (:func:`dtp.schedules.forward_only`), then one
        all-reduce over pp of the last stage's losses. ``aux`` as :meth:`schedule` gives
        it: with a tree carry (MoE) the last stage's, shared over pp; else the last
        stage's, ``None`` elsewhere."""
        self.mbs = batches
        with torch.no_grad(), use_layout(self.ctx.layout, self.smesh) if self.smesh is not None else \
                contextlib.nullcontext():
            for step in self.steps:
                for recv in step.posts:
                    self._post(*recv)
                self._F(step.item.chunk, step.item.microbatch)
        for handle in (h for hs in self.act_sends.values() for h in hs):
            handle.wait()
        self.act_sends.clear()
        auxes = [self.auxes.get(i) for i in range(self.m)] if self.auxes else None
        if self.ctx.model.carry == "tree":  # every rank reads the aux (the CLI's held-out LM loss)
            auxes = wire.share(auxes, self._holds_last(), self.ctx.mesh, self.axis)
        mine = torch.tensor([self.losses.get(i, 0.0) for i in range(self.m)], dtype=torch.float64)
        losses = comm.all_reduce(mine, self.ctx.mesh, self.axis, tag="pipeline eval loss").tolist()
        return [(loss, None if auxes is None else auxes[i]) for i, loss in enumerate(losses)]

    def gradients(self) -> Iterator[tuple[int, PyTree]]:
        return self.inner.gradients()

    def targets(self) -> list[PyTree]:
        return self.inner.targets() if self.zero else [self.params_tree]

    def opt_state(self, optimizer: Any, opt_state: PyTree, targets: list[PyTree]) -> PyTree:
        """The optimizer state of this rank's parameters, on the stage mesh (others ``None``)."""
        full = optree.tree_unflatten(self.treedef, list(range(len(self.keep))))
        if self.zero:
            # A loaded per-parameter state covers every stage: ZeRO cuts this rank's share
            # into its buckets (a state already in buckets passes through untouched).
            if opt_state is not None:
                opt_state = map_param_trees(opt_state, full, lambda name, tree: self.mirror(tree))
            return self.inner.opt_state(optimizer, opt_state, targets)
        if opt_state is None:
            return optimizer.init(targets[0])
        return map_param_trees(opt_state, full, lambda name, tree: self.mirror(tree))

    def mirror(self, tree: PyTree) -> PyTree:
        """A per-parameter tree of the whole mesh (or already this rank's) as this rank's
        stages hold it: its parameters' entries on the stage mesh, ``None`` elsewhere."""
        leaves = optree.tree_leaves(tree, none_is_leaf=True)
        return optree.tree_unflatten(self.treedef, [self._to_stage(x) if keep and x is not None else None
                                                    for x, keep in zip(leaves, self.keep)])

    def norm(self, grads: PyTree) -> torch.Tensor:
        """The gradient norm over every stage: each rank's squares (a tied parameter
        counted on the first stage only), summed over pp."""
        if self.zero:  # bucket slices: the norm over dp is ZeRO's
            local = self.inner.norm(grads) ** 2
        else:
            mine = [g for g, path in zip(optree.tree_leaves(grads, none_is_leaf=True), self.paths)
                    if g is not None and not (_owned(path, self.tied) and not self._holds_first())]
            local = global_norm(mine) ** 2 if mine else torch.zeros((), dtype=torch.float64)
        total = comm.all_reduce(local.reshape(1), self.ctx.mesh, self.axis, tag="pipeline grad norm")
        return torch.sqrt(total[0]).to(local.dtype)

    def mask_flags(self, mask: Any, name: str) -> list[Any] | None:
        """ZeRO's bucket flags under ZeRO; else ``None`` (the targets are the stage's parameters)."""
        return self.inner.mask_flags(mask, name) if self.zero else None

    def in_flight(self) -> bool:
        return self.inner.in_flight()

    def updated(self, i: int, target: PyTree) -> None:
        self.inner.updated(i, target)

    def finish(self, updated: list[PyTree]) -> tuple[PyTree, Any]:
        return self.inner.finish(updated) if self.zero else (updated[0], None)

    # ---- the schedule's actions
    def _stage(self, chunk: int) -> tuple[int, int, int]:
        return self.chunks[chunk]

    def _F(self, chunk: int, i: int) -> None:
        stage, first, stop = self._stage(chunk)
        xs, value = ([], None) if stage == 0 else self._take("act", stage, i)
        out = self.ctx.model.run(self.params(), value, self.mbs[i], first, stop)
        if stage == self.n_stages - 1:
            loss, aux = out if isinstance(out, tuple) else (out, None)
            self.losses[i] = value_of(loss.detach())
            if aux is not None:
                self.auxes[i] = aux
            if not self.forward_only:
                self.saved[(chunk, i)] = (xs, [loss / self.m])
            return
        leaves, spec = wire.flatten(out)  # the hidden state, then (MoE) the aux losses and statistics
        h, scattered = wire.scatter(leaves[0])  # in the graph: its backward gathers the gradient back
        leaves = [wire.sendable(x) for x in (h, *leaves[1:])]
        if not self.forward_only:
            self.saved[(chunk, i)] = (xs, leaves)
        self._send("act", stage + 1, i, leaves, spec, gather=scattered)

    def _B(self, chunk: int, i: int) -> None:
        self._I(chunk, i, keep_graph=False)

    def _I(self, chunk: int, i: int, keep_graph: bool = True) -> None:
        stage = self._stage(chunk)[0]
        xs, outs = self.saved.pop((chunk, i))
        # The outputs the next stage sent gradients for: those that required one, in order.
        outs = [o for o in outs if o.requires_grad]
        grads = None if stage == self.n_stages - 1 else self._take("grad", stage, i)[0]
        if (stage + 1, i) in self.act_sends:
            # Its gradient came back, so the activation arrived: let its buffer go now, not
            # at the end of the step (interleaved's peak equalled GPipe's before).
            for handle in self.act_sends.pop((stage + 1, i)):
                handle.wait()
        leaves = self._weights(chunk, i)
        if keep_graph:  # zero bubble's I: the input's gradient, and what W starts from
            dxs, self.pending_w[(chunk, i)] = pipeline_split.backward_input(outs, grads, xs, leaves, views=self.zero)
        elif xs or leaves:
            got = pipeline_split.differentiate(outs, grads, xs + leaves)
            dxs, weights = got[:len(xs)], got[len(xs):]
        if xs:
            # A gradient may come back as a pending sum like an activation: reduced before it leaves.
            dxs = [wire.sendable(g) if g is not None else torch.zeros_like(x) for g, x in zip(dxs, xs)]
            self._send("grad", stage - 1, i, dxs, optree.tree_structure(dxs))
        if not keep_graph and not self.zero:  # ZeRO's views added theirs into the buckets during backward
            self._add(chunk, weights)

    def _W(self, chunk: int, i: int) -> None:
        grads = self.pending_w.pop((chunk, i)).run(self._weights(chunk, i))
        if not self.zero:
            self._add(chunk, grads)

    def _weights(self, chunk: int, i: int) -> list[torch.Tensor]:
        """What a backward differentiates for the parameters: the chunk's leaves, or under
        ZeRO the anchor its views hang from (their backward fills the buckets)."""
        if not self.zero:
            own = self.own[chunk]
            return self.leaves if len(own) == len(self.leaves) else [self.leaves[k] for k in own]
        self.inner.begin_backward(i)
        return [self.inner.anchor]

    def _add(self, chunk: int, grads: Sequence[torch.Tensor | None]) -> None:
        """The chunk's weight gradients (:meth:`_weights`' order) into the step's accumulators."""
        own = self.own[chunk]
        if len(own) != len(self.leaves):
            full: list[torch.Tensor | None] = [None] * len(self.leaves)
            for k, g in zip(own, grads):
                full[k] = g
            grads = full
        self.inner.add(grads)

    # ---- point to point
    def _rank_of(self, stage: int) -> int:
        return schedules.stage_owner(stage, self.p, self.placement)[0]

    def _peer(self, rank: int) -> comm.Peer:
        """The pp neighbour ``rank`` for this step's messages (its group looked up once)."""
        if (peer := self.peers.get(rank)) is None:
            peer = self.peers[rank] = comm.Peer(self.ctx.mesh, self.axis, rank)
        return peer

    def _key(self, kind: str, stage: int, i: int, part: int) -> int:
        return ((stage * 2 + (kind == "grad")) * self.m + i) * _PARTS + part

    def _send(self, kind: str, stage: int, i: int, leaves: list[torch.Tensor], spec: Any,
              gather: bool = False) -> None:
        """Post a carry's ``leaves`` (an activation for ``stage``, or gradients for it) to
        its rank, one message each (:mod:`.pipeline_wire`); ``gather``: the receiver
        all-gathers leaf 0's last dim (it came scattered)."""
        to = self._rank_of(stage)
        if to == self.rank:  # interleaved with p = 1: a stage hands to the next on this rank
            self.recvs[(kind, stage, i)] = wire.Local(leaves, spec, gather)
            return
        if len(leaves) >= _PARTS - 2:
            raise ValueError(f"layouts.pipeline: a carry of {len(leaves)} tensors between stages; at most "
                             f"{_PARTS - 3} travel")
        tag, peer = f"pp {kind} stage {stage} mb {i}", self._peer(to)
        posted = []
        # Microbatches of a step share their shapes: only microbatch 0's message carries
        # headers, so the receiver can post every later body's receive ahead.
        if i == 0:
            tree = wire.tree_words(spec, leaves) if len(leaves) > 1 or (kind == "act" and spec.num_nodes > 1) else None
            posted.append(peer.send(wire.header(leaves[0], gather, 0 if tree is None else len(tree)),
                                    key=self._key(kind, stage, i, 0), tag=tag + " header"))
            if tree is not None:
                posted.append(peer.send(tree, key=self._key(kind, stage, i, 2), tag=tag + " tree"))
        for j, x in enumerate(leaves):
            local = (x.to_local() if isinstance(x, DTensor) else x).detach()
            posted.append(peer.send(local, key=self._key(kind, stage, i, 1 if j == 0 else 2 + j),
                                    tag=tag + (f" leaf {j}" if j else "")))
        if kind == "act":
            self.sends += posted[:-len(leaves)] if i == 0 else []
            self.act_sends[(stage, i)] = posted[-len(leaves):]  # waited for at this microbatch's backward
        else:
            self.sends += posted

    def _in_lanes(self, a: "schedules.Action", b: "schedules.Action") -> None:
        """``ep_overlap`` (:mod:`.ep_overlap`): an F and a B of two microbatches side by side
        on two lanes, one's expert all-to-alls under the other's compute. Both inputs are
        received first, here, so no lane ever blocks on another stage (the turn moves only
        at the all-to-alls: the same order on every rank of the stage)."""
        for action in (a, b):  # a hand-over within the rank is already in self.recvs
            key = receive_of(action, self.rank, self.p, self.placement, self.n_stages)
            if key is not None:
                self._post(*key)
                self.recvs[key] = _Arrived(self.recvs.pop(key).wait())
        enter = ep_overlap.carry()

        def lane(action: "schedules.Action") -> Callable[[], None]:
            def work() -> None:
                with enter():
                    getattr(self, f"_{action.kind}")(action.chunk, action.microbatch)
            return work

        lanes.run([lane(a), lane(b)])

    def _post(self, kind: str, stage: int, i: int) -> None:
        key = (kind, stage, i)
        if key in self.posted:
            return
        frm = self._rank_of(stage - 1 if kind == "act" else stage + 1)
        if frm == self.rank:
            return  # handed over locally by _send
        self.posted.add(key)
        peer = self._peer(frm)
        header = None if i else peer.recv((wire.HEADER,), torch.int64, key=self._key(kind, stage, i, 0),
                                          tag=f"pp {kind} stage {stage} mb 0 header")
        self.recvs[key] = wire.Incoming(self.meta, (kind, stage), header, peer,
                                        lambda part: self._key(kind, stage, i, part),
                                        f"pp {kind} stage {stage} mb {i}", self.smesh)

    def _take(self, kind: str, stage: int, i: int) -> tuple[list[torch.Tensor], Any]:
        """``(the leaves to differentiate, the carry as used)``: received activations
        that required a gradient become leaves that do (their gradients go back as they
        came); one that came scattered over tp is all-gathered for use. Gradients:
        ``(the list, the list)``."""
        self._post(kind, stage, i)
        leaves, spec, gathers, needs = self.recvs.pop((kind, stage, i)).wait()
        if i == 0:  # its header is read: the channel's later receives posted ahead get their bodies posted
            for (k, s, _), pending in self.recvs.items():
                if (k, s) == (kind, stage) and isinstance(pending, wire.Incoming):
                    pending.post_bodies()
        if kind != "act":
            return leaves, leaves
        for j, x in enumerate(leaves):
            if needs[j] and x.is_floating_point():
                x.requires_grad_(True)
        xs = [x for x in leaves if x.requires_grad]
        used = list(leaves)
        if gathers[0]:
            x = leaves[0]
            src = spec_of(x)
            used[0] = reshard(x, P(*[() if d == x.dim() - 1 else src.axes_of(d) for d in range(x.dim())]),
                              tag="pp gather")
        return xs, optree.tree_unflatten(spec, used)

    # ---- after the schedule
    def _holds_first(self) -> bool:
        return any(stage == 0 for stage, _, _ in self.chunks)

    def _holds_last(self) -> bool:
        return any(stage == self.n_stages - 1 for stage, _, _ in self.chunks)

    def _sum_tied(self) -> None:
        first, last = self._rank_of(0), self._rank_of(self.n_stages - 1)
        if not self.tied or first == last or self.rank not in (first, last):
            return
        peer = last if self.rank == first else first
        for j, (path, keep) in enumerate(zip(self.paths, self.keep)):
            if not keep or not _owned(path, self.tied):
                continue
            k = self.held[j]
            g, leaf = self.inner.grad(k), self.leaves[k]
            if g is None:  # a stage that does not read it after all: its share is zero
                g = torch.zeros_like(leaf, dtype=accum_dtype(leaf.dtype) if self.inner.accumulate else leaf.dtype)
            if isinstance(g, DTensor) and spec_of(g) != spec_of(leaf):
                # Each end's gradient in the parameter's layout first (its dp reduction),
                # so the two add as plain local tensors whatever their pending sums were.
                g = reshard(g, spec_of(leaf), tag="grad reduce")
            local = g.to_local() if isinstance(g, DTensor) else g
            key = 2 ** 30 + j  # above every stage message's key
            send = comm.send(local, self.ctx.mesh, self.axis, to=peer, key=key, tag=f"pp tied grad {path}")
            theirs = comm.recv(local.shape, local.dtype, self.ctx.mesh, self.axis, frm=peer, key=key,
                               tag=f"pp tied grad {path}", device=local.device).wait()
            send.wait()
            summed = local + theirs
            self.inner.set_grad(k, summed if not isinstance(g, DTensor) else
                                DTensor.from_local(summed, g.device_mesh, g.placements, run_check=False,
                                                   shape=g.shape, stride=g.stride()))

    def _loss(self) -> float:
        mine = sum(self.losses.values()) / self.m if self._holds_last() else 0.0
        total = comm.all_reduce(torch.tensor([mine], dtype=torch.float64), self.ctx.mesh, self.axis,
                                tag="pipeline loss")
        return float(total[0])


def gather(params: PyTree, mesh: DeviceMesh, axis: str) -> PyTree:
    """Every stage's parameters on every pp rank, each on the stage mesh (a collective
    over ``pp``: call it on every rank). Per parameter: which ranks hold it, its header
    (shape, dtype, placements) and its value, each one all-reduce over ``pp``, the value
    from the lowest holder."""
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
    if all(x is not None for x in leaves):
        return params  # before the first step every rank holds everything
    smesh = stage_mesh(mesh, axis)
    me = coordinates(mesh)[axis]
    out = []
    for j, x in enumerate(leaves):
        held = torch.tensor([float(me if x is not None else 1e9)], dtype=torch.float64)
        owner = int(-comm.all_reduce(-held, mesh, axis, op="max", tag=f"pp gather owner {j}")[0])
        header = wire.header(x) if me == owner else torch.full((wire.HEADER,), -(2 ** 40), dtype=torch.int64)
        header = comm.all_reduce(header, mesh, axis, op="max", tag=f"pp gather header {j}")
        shape, dtype, placements, _, _ = wire.read_header(header, smesh)
        local = (x.to_local() if isinstance(x, DTensor) else x).detach() if me == owner else \
            torch.zeros(wire.local_size(shape, smesh, placements), dtype=dtype, device=mesh_device(mesh))
        local = comm.all_reduce(local, mesh, axis, tag=f"pp gather {j}")
        if placements is None:
            out.append(local.requires_grad_(True))
        else:
            out.append(DTensor.from_local(local, smesh, placements, run_check=False, shape=torch.Size(shape),
                                          stride=wire.contiguous(shape)).requires_grad_(True))
    return optree.tree_unflatten(treedef, out)
