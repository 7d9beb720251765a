"""ZeRO 1/2/3 — Megatron's distributed optimizer, expressed as placements.

Under ``layouts.zero(stage)`` every rank's shard of the parameters (its tensor/sequence
parallel piece, replicated over the ZeRO axis ``dp``) is packed into contiguous flat
**buckets**, each padded to split evenly over ``dp``; rank r owns slice r of every
bucket. In placement terms:

* a gradient leaves backward as a pending sum over ``dp`` — ``Partial → Shard`` is the
  bucket's **reduce-scatter**;
* optimizer state and fp32 master weights live only as the owner's slice — flat
  DTensors sharded over ``dp`` (and over whatever else splits the bucket's parameters);
* the updated slices go ``Shard → Replicate`` — the bucket's **all-gather** — straight
  into the buffer the next forward reads its parameters from (stage 1/2), or stay slices
  at rest and are gathered bucket by bucket just before use (stage 3).

The model never sees any of this: ``train_step`` hands ``loss_fn`` a read-only view of
the parameter tree (``Mapping``/``Sequence`` mirrors of its dicts and lists) whose
leaves materialise on first read. That read is where the forward waits for a bucket's
in-flight all-gather (``overlap_param_gather``), where stage 3 gathers it (prefetching
the next), and where the first step records the parameters' real use order, from which
the buckets are built (``--reset-bucket-group-order``: creation order never matters).
Each leaf is a differentiable view whose backward adds the gradient into its bucket and,
when the bucket's last gradient of the last microbatch is in, posts the bucket's
reduce-scatter (``overlap_grad_reduce``). Every collective goes through :mod:`dtp.comm`.

Bytes per rank and step, Ψ = parameter bytes of a rank's shard (ring algorithms,
(dp−1)/dp factors left out): stage 1/2 reduce-scatter Ψ + all-gather Ψ = 2Ψ, the same as
DDP's all-reduce; stage 3 adds the backward re-gather: 3Ψ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, ContextManager, Iterator, Sequence

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...core import comm
from ...core._rules import accum_dtype  # gradients and master weights of bf16/fp16 params are fp32 (Megatron's)
from ...layouts import Layout
from ...layouts.zero import ZeroOptions
from ...ops.local_batch import LocalBatch
from ...core._torch import local_tensor
from ..optim import global_norm, map_param_trees
from ..optim.transform import mask_leaves
from ...core.redistribute import reshard
from ...core.spec import P, wrap_local, wrap_placed, spec_of
from .zero_plan import (Bucket, Leaf, ZeroPlan, bytes_per_parameter, check_same_plan, flat_global, gather_bucket,
                        leaf, make_plan, param_slice, slice_flags, slice_of)
from .state import StrategyState, register_state
from .zero_gathers import InflightGathers
from .zero_pieces import saved_slices, slices_of
from .zero_views import LazyMapping, LazySequence, ParamView, in_backward

__all__ = ["ZeroState", "ZeroPlan", "Bucket", "Leaf", "InflightGathers", "Run", "options", "gather", "at_rest", "from_parts",
           "bytes_per_parameter"]

PyTree = Any


def options(layout: Layout, mesh: DeviceMesh) -> ZeroOptions | None:
    """The layout's ZeRO options when they apply on ``mesh`` (axis present, size > 1)."""
    return layout.zero if layout.zero is not None and layout.zero.active(mesh) else None


@dataclass(frozen=True)
class ZeroState(StrategyState):
    """ZeRO's part of a :class:`dtp.TrainState` (``state.strategy``): the plan, the
    master-weight slices and, stage 1/2, the gathered parameter buffers with any gathers
    still in flight.

    Plain data: reading a field never communicates. ``pending`` is the one thing that
    changes (waiting on it); ``dtp.gather_params(state)`` waits, or under stage 3 gathers.
    Its pytree children are the master slices (flat DTensors sharded over dp). It answers
    :class:`~dtp.strategies.state.StrategyState`'s questions for ZeRO: a checkpoint gets
    each parameter's part of the slices as rectangles (:mod:`.zero_pieces`), never a
    gathered parameter."""

    keeps_master: ClassVar[bool] = True  # fp32 master slices and moments of bf16 parameters

    options: ZeroOptions
    leaves: tuple[Leaf, ...]
    skeleton: PyTree  # the params tree with leaf indices for leaves
    plan: ZeroPlan | None = None
    master: tuple[DTensor, ...] = ()
    buffers: tuple[torch.Tensor, ...] = ()  # stage 1/2: gathered params
    pending: InflightGathers = field(default_factory=InflightGathers)
    # Before the plan: master weights a checkpoint brought (per parameter, laid out like
    # the parameters, in the master dtype); step one cuts them into the master slices.
    loaded_master: PyTree = None

    @property
    def stage(self) -> int:
        return self.options.stage

    def wait(self) -> None:
        """Wait for every in-flight parameter all-gather (no new collective)."""
        self.pending.wait()

    def describe(self) -> str:
        return f", zero=stage {self.stage}"

    @property
    def owns_params(self) -> bool:
        return self.plan is not None  # after step one the parameters are views of its buffers

    def gather(self, params: PyTree) -> PyTree:
        return gather(self, params)

    def specs(self, params: PyTree) -> Iterator[P | None]:
        for x in self.leaves:
            yield x.spec

    def run(self, params: PyTree, microbatches: int, *, local: LocalBatch | None = None) -> "Run":
        return Run(self, params, microbatches, local=local)

    def stage_state(self) -> "ZeroState":
        return self

    def gradients_only(self) -> str | None:
        return ("value_and_grad: a ZeRO state's gradients are reduce-scattered into bucket slices inside "
                "dtp.train_step; call train_step (or drop layouts.zero)")

    def master_tree(self) -> PyTree:
        return self.loaded_master  # before the plan: what a checkpoint brought, per parameter

    def saved(self, params: PyTree, opt_state: PyTree) -> dict[str, Any]:
        if self.plan is None:  # before step one: per parameter (master_tree: what a checkpoint brought)
            return super().saved(params, opt_state)
        return saved_slices(self.plan, self.leaves, self.master, opt_state)  # after step one: the slices

    def manifest(self) -> dict[str, Any]:
        return {"zero_stage": self.stage}

    def empty_params(self, params: PyTree) -> PyTree:
        # From the leaves, not ``params``: stage 3 keeps none after step one.
        leaves = [wrap_local(torch.empty(x.local_shape, dtype=x.dtype), x.mesh, x.spec, x.shape)
                  for x in self.leaves]
        return optree.tree_map(lambda i: leaves[i], self.skeleton)

    def restored(self, params: PyTree, master: PyTree, opt_state: PyTree, optimizer: Any,
                 own: Any = None) -> tuple[PyTree, Any]:
        # Per parameter, as before step one: step one cuts params, master and moments into buckets.
        return opt_state, ZeroState(self.options, self.leaves, self.skeleton, loaded_master=master)



optree.register_pytree_node(
    ZeroState,
    lambda z: ((z.master, z.loaded_master), (z.options, z.leaves, z.skeleton, z.plan, z.buffers, z.pending),
               ("master", "loaded_master")),
    lambda aux, children: ZeroState(aux[0], aux[1], aux[2], aux[3], tuple(children[0]), *aux[4:],
                                    loaded_master=children[1]),
    namespace="dtp",
)


def gather(z: ZeroState, raw: PyTree) -> PyTree:
    """The parameters as a tree of DTensors laid out as the layout says.

    Stage 1/2 waits for in-flight gathers (no new collective); stage 3 all-gathers
    every bucket — a collective: call it on every rank."""
    if z.plan is None:
        return raw
    z.pending.wait()
    if z.stage < 3:
        return raw
    bufs = [gather_bucket(z.plan, b, param_slice(z.master[b.index], b), async_op=False, tag="zero3 read")
            for b in z.plan.buckets]
    return _tree_of_views(z, bufs, requires_grad=True)


def create(params: PyTree, opts: ZeroOptions) -> ZeroState:
    """ZeRO state for freshly laid-out ``params`` (DTensors); buckets come in step one."""
    leaves, treedef = optree.tree_flatten(params)
    paths = [".".join(map(str, p)) for p in optree.tree_paths(params)]
    metas = [leaf(path, x.device_mesh, spec_of(x), tuple(x.shape), x.dtype, opts.axis)
             for path, x in zip(paths, leaves)]
    skeleton = optree.tree_unflatten(treedef, list(range(len(leaves))))
    return ZeroState(opts, tuple(metas), skeleton)


def from_parts(opts: ZeroOptions, leaves: Sequence[Leaf], structure: Any, parts: Sequence[torch.Tensor],
               plan: ZeroPlan, mesh: DeviceMesh) -> ZeroState:
    """The state as after step one's bucketing, parameters not gathered yet (no collective:
    :func:`at_rest` gathers them), from this rank's runs of each parameter in its slices
    (``parts``: :func:`.zero_pieces.slices_of`): what ``TrainState.from_hf`` reads."""
    skeleton = optree.tree_unflatten(structure, list(range(len(leaves))))
    return ZeroState(opts, tuple(leaves), skeleton, plan, slices_of(plan, leaves, parts, mesh))


def _make(params: PyTree, optimizer: Any, opts: ZeroOptions, layout: Layout, mesh: DeviceMesh) -> Any:
    # On a mesh where it applies; buckets and the sharded optimizer state come in step one.
    return (None, create(params, opts)) if mesh.size() > 1 and opts.active(mesh) else None


register_state("zero", _make, order=10)


def _tree_of_views(z: ZeroState, bufs: Sequence[torch.Tensor], *, requires_grad: bool) -> PyTree:
    out: list[torch.Tensor | None] = [None] * len(z.leaves)
    for b, buf in zip(z.plan.buckets, bufs):
        for i, off in zip(b.members, b.offsets):
            leaf = z.leaves[i]
            out[i] = wrap_local(leaf.view(buf, off), leaf.mesh, leaf.spec, leaf.shape).requires_grad_(requires_grad)
    return optree.tree_map(lambda i: out[i], z.skeleton)


class Run:
    """One train step under ZeRO (a :class:`dtp.strategies.StepRun`): the forward's
    parameter view, the gradient buckets, and the update of this rank's master slices."""

    grouped = True  # the optimizer state covers the list of master slices, one per bucket

    def __init__(self, z: ZeroState, raw: PyTree, microbatches: int, *, local: LocalBatch | None = None):
        # The first step fixes the plan on the run's own copy of the (frozen) state, never
        # on the caller's; the in-flight gathers are shared: waiting on one is idempotent.
        self.z, self.microbatches = z, microbatches
        # Local batch mode (:mod:`.local`): the forward reads the bucket views as plain
        # tensors and their gradients arrive as this rank's plain terms (pending over dp).
        self.local = local
        self.raw_leaves = None if z.plan is not None else [x.to_local() for x in optree.tree_leaves(raw)]
        self.device = (self.raw_leaves[0] if self.raw_leaves else z.master[0].to_local()).device
        self.anchor = torch.zeros((), requires_grad=True, device=self.device)
        self.used: list[int] = []  # first step: every read, in order
        self.position = 0  # reads so far in this microbatch's forward
        self.views = [0] * len(z.leaves)
        self.microbatch = 0
        self.grad_bufs: list[torch.Tensor | None] = []
        self.parts: dict[int, dict[int, torch.Tensor]] = {}  # bucket -> leaf -> gradient held until copy-in
        self.pending: list[int] = []
        self.reduce: list[comm.CommHandle | None] = []
        self.reduce_order: list[int] = []  # buckets in the order their reduce-scatters were posted
        self.unlanded: list[int] = []  # of those, the ones not yet waited for
        self.live: dict[int, torch.Tensor] = {}  # stage 3: gathered buckets now held
        # Stage 3 frees a bucket after forward's last read (re-gathered in backward) unless
        # reshard_after_forward=False; backward frees it after its last gradient either way.
        self.reshard = z.options.reshard_after_forward
        self.prefetch_depth = z.options.prefetch  # stage 3: buckets gathered ahead
        self.prefetch: dict[int, comm.CommHandle] = {}
        self.live_ptrs: dict[int, int] = {}
        self.posted: dict[int, tuple[torch.Tensor | None, comm.CommHandle]] = {}  # gathers updated() posted

    # ---- forward
    def params(self) -> PyTree:
        return self.resolve(self.z.skeleton)

    def forward(self) -> ContextManager[None]:
        # Stage 3: saved activations refer to their bucket instead of holding it.
        if self.z.stage == 3:
            return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        return contextlib.nullcontext()

    def resolve(self, node: Any) -> Any:
        if isinstance(node, int) and not isinstance(node, bool):
            return self.leaf(node)
        if type(node) is dict:
            return LazyMapping(node, self)
        if type(node) in (list, tuple):
            return LazySequence(node, self)
        # Other containers (NamedTuple, custom nodes): materialise the whole subtree.
        return optree.tree_map(self.leaf, node)

    def leaf(self, i: int) -> DTensor:
        counting = not in_backward()
        if counting and self.z.plan is None:
            self.used.append(i)
        local = self._local(i)
        out = ParamView.apply(self.anchor, local, self, i)
        if counting:
            self.views[i] += 1
            self.position += 1
        return out

    def _local(self, i: int) -> torch.Tensor:
        z = self.z
        if self.raw_leaves is not None:  # the first step reads the laid-out params as they are
            return self.raw_leaves[i]
        b, off = z.plan.where[i]
        return z.leaves[i].view(self._bucket_buffer(b), off)

    def _bucket_buffer(self, b: int) -> torch.Tensor:
        z = self.z
        if z.stage < 3:
            z.pending.wait(b)  # first use: wait for this bucket's all-gather only
            return z.buffers[b]
        return self._gathered(b, ahead=-1 if in_backward() else 1)

    def _gathered(self, b: int, ahead: int) -> torch.Tensor:
        """Stage 3: bucket ``b`` whole, gathering it (or waiting for its prefetch) and
        prefetching the ``prefetch`` buckets after it in the direction of travel
        (``ahead`` = +1 forward, -1 backward)."""
        plan = self.z.plan
        if b not in self.live:
            handle = self.prefetch.pop(b, None) or self.z.pending.take(b) or self._post_gather(b)
            self._hold(b, handle.wait())
        if ahead > 0 and self.reshard:  # forward: free what the first step's forward read for the last time
            for k in [k for k in self.live if k != b and plan.buckets[k].last_use < self.position]:
                self._release(k)
        for d in range(1, self.prefetch_depth + 1):
            nxt = b + ahead * d
            if 0 <= nxt < len(plan.buckets) and nxt not in self.live and nxt not in self.prefetch:
                self.prefetch[nxt] = self.z.pending.take(nxt) or self._post_gather(nxt)
        return self.live[b]

    def _post_gather(self, b: int) -> comm.CommHandle:
        plan = self.z.plan
        bucket = plan.buckets[b]
        tag = "zero3 backward gather" if in_backward() else "zero3 gather"
        return gather_bucket(plan, bucket, param_slice(self.z.master[b], bucket), async_op=True, tag=tag)

    def _hold(self, b: int, buf: torch.Tensor) -> None:
        self.live[b] = buf
        ptr = buf.untyped_storage().data_ptr()
        self.live_ptrs[ptr] = b
        weakref.finalize(buf, self.live_ptrs.pop, ptr, None)

    def _release(self, b: int) -> None:
        self.live.pop(b, None)

    # ---- stage 3: saved activations refer to a bucket instead of holding it
    def pack(self, t: torch.Tensor) -> Any:
        local = local_tensor(t) if isinstance(t, DTensor) else t
        if not self.live_ptrs or local.layout != torch.strided:
            return t
        try:
            b = self.live_ptrs.get(local.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if b is None:
            return t
        meta = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return _Saved(b, local.storage_offset(), tuple(local.shape), local.stride(), meta)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        buf = self._gathered(saved.bucket, ahead=-1)
        local = buf.as_strided(saved.shape, saved.stride, saved.offset)
        if saved.meta is None:
            return local
        mesh, placements, shape, stride = saved.meta
        return wrap_placed(local, mesh, placements, shape, stride)

    # ---- backward
    def backward(self, loss: torch.Tensor, microbatch: int) -> None:
        """Backward of one microbatch: every parameter's gradient lands in its bucket
        (through the views' backward), the last microbatch's completes buckets post their
        reduce-scatters."""
        self.begin_backward(microbatch)
        torch.autograd.grad(loss, [self.anchor], allow_unused=True)

    def begin_backward(self, microbatch: int) -> None:
        """After each microbatch's forward: (first step) fix the buckets, then count the
        views each bucket waits for."""
        self.microbatch = microbatch
        if self.z.plan is None:
            self.z = dataclasses.replace(self.z, plan=make_plan(self.z.leaves, self.z.options, self.used))
            check_same_plan(self.z.plan, self.device)
        z = self.z
        self.position = 0
        if not self.grad_bufs:
            self.grad_bufs = [None] * len(z.plan.buckets)
            self.reduce = [None] * len(z.plan.buckets)
        self.pending = [sum(self.views[i] for i in b.members) for b in z.plan.buckets]
        self.views = [0] * len(z.leaves)
        if z.stage == 3 and self.reshard:  # forward is over: keep only the last bucket read, which backward needs first
            last = max(self.live, key=lambda k: z.plan.buckets[k].last_use, default=None)
            for k in [k for k in self.live if k != last]:
                self._release(k)

    def add_grad(self, i: int, grad: torch.Tensor) -> None:
        z, plan = self.z, self.z.plan
        leaf = z.leaves[i]
        if not isinstance(grad, DTensor):
            if self.local is None:
                raise TypeError(f"param {leaf.path}: gradient is a plain tensor; expected a DTensor")
            local = grad  # local batch mode: this rank's term, pending over dp as the bucket expects
        else:
            # Resolve every pending sum but dp's (e.g. norm weights under SP over tp); dp's
            # is what the bucket's reduce-scatter is for.
            target = P(*leaf.spec.dims, partial=(plan.axis,))
            if spec_of(grad) != target:
                grad = reshard(grad, target, name=f"grad {leaf.path}", tag="grad reduce")
            local = local_tensor(grad)
        b, off = plan.where[i]
        if self.grad_bufs[b] is not None:  # a later microbatch: add into the accumulator
            leaf.view(self.grad_bufs[b], off).add_(local)
        else:
            # Keep the gradient as it came until the bucket's last one is in, then copy them
            # all into the flat bucket at once (FSDP2's copy-in at post-backward): the
            # whole-size buffer then exists only once this bucket's backward is over and
            # its activations are freed, not from its first gradient on (the step's peak).
            parts = self.parts.setdefault(b, {})
            held = parts.get(i)
            parts[i] = local if held is None else held.to(accum_dtype(held.dtype)) + local
        self.pending[b] -= 1
        self._land()
        last = self.microbatch == self.microbatches - 1
        if self.pending[b] == 0:
            if z.stage == 3:
                self._release(b)
            if last and z.options.overlap_grad_reduce:
                self._post_reduce(b)
            elif b in self.parts:
                self._grad_buffer(b)  # into the accumulator now: the held gradients go

    def _grad_buffer(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s full gradient accumulator: on first use the gradients held for it
        copied in (zeros where none came, and in the padding)."""
        if self.grad_bufs[b] is None:
            bucket = self.z.plan.buckets[b]
            buf = torch.empty(bucket.numel, dtype=accum_dtype(bucket.dtype), device=self.device)
            parts, end = self.parts.pop(b, {}), 0
            for i, off in zip(bucket.members, bucket.offsets):
                view, g = self.z.leaves[i].view(buf, off), parts.get(i)
                view.zero_() if g is None else view.copy_(g)
                end = max(end, off + self.z.leaves[i].numel)
            buf[end:].zero_()
            self.grad_bufs[b] = buf
        return self.grad_bufs[b]

    def _post_reduce(self, b: int) -> None:
        plan = self.z.plan
        self.reduce[b] = comm.reduce_scatter(self._grad_buffer(b), plan.mesh, plan.axis, async_op=True,
                                             tag=f"grad bucket {b}")
        self.reduce_order.append(b)
        self.unlanded.append(b)
        if self.z.stage >= 2:  # only the slice outlives the reduce-scatter (the handle keeps it until done)
            self.grad_bufs[b] = None

    def _land(self) -> None:
        """Reduce-scatters that have completed land now (a wait that does not block): each
        handle then keeps only its 1/dp slice, so the whole-size bucket and the receive
        buffer go at once, not at the update (as FSDP2 frees its reduce-scatter input);
        one still on the wire stays there, never stalling backward. Asked at every
        gradient, not only at the next bucket's post: the head's bucket (llama "small":
        0.25 MiB + its 0.125 MiB receive buffer) otherwise sat through the next block's
        backward, where the step peaks (profiled)."""
        if self.unlanded:
            for i in [i for i in self.unlanded if self.reduce[i].is_completed()]:
                self.reduce[i].wait()
                self.unlanded.remove(i)

    def gradients(self) -> Iterator[tuple[int, DTensor]]:
        """``(bucket, reduced gradient slice)`` for every bucket, in the order the
        reduce-scatters were posted (backward's), so a caller can use each slice as soon
        as it lands while later ones are still on the wire; buckets backward did not post
        (no overlap, or unused) are posted and yielded last."""
        plan = self.z.plan
        mesh = plan.mesh
        for b in plan.buckets:
            if self.reduce[b.index] is None:
                self._post_reduce(b.index)
        # Backward is over: what it gathered (stage 3) and the full gradient buckets (the
        # in-flight reduce-scatters hold what they still need) are not needed any more.
        for handle in self.prefetch.values():  # a backward prefetch nobody needed in the end
            handle.wait()
        self.prefetch.clear()
        self.live.clear()
        self.grad_bufs = []
        self.unlanded = []  # waited for below
        try:
            for i in list(self.reduce_order):
                b = plan.buckets[i]
                handle = self.reduce[i]
                assert handle is not None
                self.reduce[i] = None  # the slice is the caller's now; drop the handle
                yield i, wrap_local(handle.wait(), mesh, b.spec, flat_global(b, mesh))
        finally:
            # A caller that stops early (an optimizer that raised) must not leave
            # collectives unwaited: every rank posted them.
            for handle in self.reduce:
                if handle is not None:
                    handle.wait()
            self.reduce = [None] * len(plan.buckets)


    # ---- update
    def targets(self) -> list[DTensor]:
        """This rank's fp32 master slices, one per bucket (sliced out of the replicated
        parameters, or of the master weights a checkpoint loaded, in the first step)."""
        z = self.z
        return list(z.master) if z.master else self.cut(z.loaded_master)

    def cut(self, tree: PyTree | None) -> list[DTensor]:
        """A per-parameter tree laid out like the parameters (``None``: the parameters)
        cut into this rank's flat bucket slices, in the master dtype."""
        z, plan = self.z, self.z.plan
        leaves = self.raw_leaves if tree is None else [x.to_local() for x in optree.tree_leaves(tree)]
        out = []
        for b in plan.buckets:
            flat = torch.zeros(b.numel, dtype=accum_dtype(b.dtype), device=self.device)
            for i, off in zip(b.members, b.offsets):
                z.leaves[i].view(flat, off).copy_(leaves[i])
            out.append(wrap_local(slice_of(plan, b, flat).clone(), plan.mesh, b.spec, flat_global(b, plan.mesh)))
        return out

    def opt_state(self, optimizer: Any, opt_state: PyTree, targets: list[DTensor]) -> PyTree:
        """The optimizer state over the master slices. In step one: a fresh one
        (``opt_state is None``), or a per-parameter state (a loaded checkpoint's) cut into
        the buckets like the master weights."""
        if self.z.master:
            return opt_state
        if opt_state is None:
            return optimizer.init(targets)
        return map_param_trees(opt_state, self.z.skeleton, lambda name, tree: self.cut(tree))

    def norm(self, grads: PyTree) -> torch.Tensor:
        return global_norm(grads)

    def mask_flags(self, mask: Any, name: str) -> list[Any]:
        """An optimizer's per-parameter mask (weight decay's) as it falls on this rank's
        bucket slices, one flag per bucket (:func:`.zero_plan.slice_flags`); the mask is
        read off the parameters' shapes and dtypes (meta tensors: stage 3 holds no whole
        parameter)."""
        z = self.z
        metas = optree.tree_map(lambda i: torch.empty(z.leaves[i].shape, dtype=z.leaves[i].dtype, device="meta"),
                                z.skeleton)
        return slice_flags(z.plan, z.leaves, mask_leaves(name, mask, metas))

    def in_flight(self) -> bool:
        """Some bucket's reduce-scatter that :meth:`gradients` has not yielded is still on
        the wire (asking does not wait)."""
        return any(h is not None and not h.is_completed() for h in self.reduce)

    def updated(self, i: int, target: DTensor) -> None:
        """Bucket ``i``'s new master slice is final (the update went in bucket order):
        under ``overlap_param_gather`` its all-gather goes now, so the rest of the update
        runs under it — every bucket's for stage 1/2; for stage 3 the next forward's
        first ``prefetch`` + 1 (what that forward holds at its first read), left in the
        state for it. Profiled (benchmarks/zero_overlap.py, link as slow as compute): with
        stage 3's posted at the next forward's first read, the link idled through 75-90 %
        of the update; stage 1/2's, posted at :meth:`finish`, waited for the whole update."""
        z = self.z
        if not z.options.overlap_param_gather:
            return
        bucket = z.plan.buckets[i]
        if z.stage < 3:
            self.posted[i] = _post_param_gather(z.plan, bucket, target)
        elif i <= self.prefetch_depth:
            buf = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
            self.posted[i] = (buf, gather_bucket(z.plan, bucket, param_slice(target, bucket), async_op=True,
                                                 tag="zero3 gather", out=buf))

    def finish(self, updated: list[DTensor]) -> tuple[PyTree, ZeroState]:
        """The new state: updated master slices, and (stage 1/2) every bucket's all-gather
        posted in forward-use order (those :meth:`updated` has not posted yet) — left in
        flight with ``overlap_param_gather``, which the next forward waits for bucket by
        bucket."""
        return at_rest(self.z, tuple(m.detach() for m in updated), posted=self.posted)


def at_rest(z: ZeroState, master: Sequence[DTensor],
            posted: dict[int, tuple[torch.Tensor | None, comm.CommHandle]] | None = None) -> tuple[PyTree, ZeroState]:
    """``(params, state)`` at rest from this rank's master slices (one per bucket of
    ``z.plan``): stage 3 keeps only the slices (``params`` is ``None``) and the gathers
    ``posted`` for the next forward; stage 1/2 post every bucket's all-gather into the
    buffers the next forward reads, in forward-use order, left in flight under
    ``overlap_param_gather`` (``posted``: the ``(buffer, handle)`` of buckets already
    posted from these slices). A collective over the ZeRO axis (stage 1/2): call it on
    every rank."""
    plan, master, posted = z.plan, tuple(master), posted or {}
    if z.stage == 3:
        slots = [posted.get(b, (None, None)) for b in range(len(plan.buckets))]
        ahead = InflightGathers([h for _, h in slots], hold=True, buffers=[buf for buf, _ in slots])
        return None, ZeroState(z.options, z.leaves, z.skeleton, plan, master, pending=ahead)
    overlap = z.options.overlap_param_gather
    buffers, handles = [], []
    for b in plan.buckets:  # in forward-use order: the first needed is the first done
        buf, h = posted[b.index] if b.index in posted else _post_param_gather(plan, b, master[b.index])
        if not overlap:
            h.wait()
        buffers.append(buf)
        handles.append(h if overlap else None)
    new = ZeroState(z.options, z.leaves, z.skeleton, plan, master, tuple(buffers), InflightGathers(handles))
    # Views of the buffers, possibly still being filled: dtp.gather_params(state) waits.
    return _tree_of_views(new, new.buffers, requires_grad=True), new


def _post_param_gather(plan: ZeroPlan, b: Bucket, master: DTensor) -> tuple[torch.Tensor, comm.CommHandle]:
    """Stage 1/2: bucket ``b``'s all-gather from this rank's master slice into a new
    buffer (in the parameters' dtype), posted asynchronously."""
    buf = torch.empty(b.numel, dtype=b.dtype, device=master.to_local().device)
    return buf, gather_bucket(plan, b, param_slice(master, b), async_op=True, tag="param gather", out=buf)


@dataclass(frozen=True)
class _Saved:
    bucket: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    meta: Any
