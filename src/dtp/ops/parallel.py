"""Vocab-parallel embedding and cross-entropy (Megatron's), on DTensors or plain tensors.

Both work on the local vocab shard and never gather the full vocabulary: the embedding
returns a pending sum over the vocab axes (the layout's next ``constrain`` resolves it
with an all-reduce, or a reduce-scatter under sequence parallel), and the loss exchanges
only per-token scalars — a max and a (sum-exp, target-logit) pair — over the vocab axes.

Loss masks: a target equal to :data:`IGNORE_INDEX` (-100, Hugging Face's convention) is
skipped, and the mean is over the valid targets of the *global* batch, whatever splits it.
Inside ``train_step`` the divisor is the valid targets of the step's whole batch (every
microbatch, every rank: :func:`mean_over`), so gradient accumulation and every layout equal
one device taking the batch at once.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

from ..core import comm
from . import collective_matmul
from .local_batch import batch_sum
from ..core._rules import IGNORE_INDEX, accum_dtype
from ..core.redistribute import local_map, reshard
from ..core.mesh.devices import axis_names, block_index
from ..core.spec import P, spec_of

__all__ = ["linear", "add_bias", "embedding", "cross_entropy", "count_targets", "mean_over", "mean_over_here",
           "IGNORE_INDEX"]

_divisor = threading.local()  # mean_over's divisor in this thread (the loss runs in the step's thread)


def _vocab_offset(mesh, axes: tuple[str, ...], local_size: int) -> int:
    return block_index(mesh, axes) * local_size


def _ordered(mesh, axes) -> tuple[str, ...]:
    names = axis_names(mesh)
    return tuple(a for a in names if a in set(axes))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w`` (``+ b``) for ``x`` (..., in), ``w`` (in, out) and a bias ``b`` (out,),
    column or row parallel by layout; the bias as :func:`add_bias` adds it.

    The shards multiply locally and the output's layout is stated, not searched for:
    ``x``'s leading dims keep their split, the last dim takes ``w``'s output split
    (column parallel), and a split of the contracted dim (``x``'s last dim and ``w``'s
    rows, row parallel) becomes a pending sum. No collective runs here; the next
    ``constrain`` resolves pending sums. (DTensor's own matmul propagation searches
    redistribution costs, which takes minutes per op on a 3-D mesh.)

    >>> linear(torch.ones(2, 3), torch.ones(3, 4)).shape
    torch.Size([2, 4])
    """
    return _matmul(x, w) if b is None else add_bias(_matmul(x, w), b)


def add_bias(y: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``y + b`` for ``y`` (..., out) and ``b`` (out,): on DTensors each rank adds its block
    of ``b`` (reshards ``b`` to ``y``'s split of the last dim when it differs) to its
    shard of ``y``; ``b``'s gradient is a pending sum over the axes that split ``y``'s
    other dims. No collective when ``b`` is laid out as ``y``'s last dim (a column-parallel
    weight's bias split as its output features).

    Raises: ``ValueError`` when ``y`` holds a pending sum (a row-parallel output): each
    term would add ``b`` once; add it after the sum is resolved (``constrain``).

    >>> add_bias(torch.zeros(2, 3), torch.arange(3.0)).tolist()
    [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    """
    if not isinstance(y, DTensor):
        return y + b
    ys = spec_of(y)
    if ys.partial:  # (so is an async-tp row-parallel output, not computed yet)
        raise ValueError(f"add_bias: the output holds a pending sum over {ys.partial} (spec {ys}), so each term "
                         f"would add the bias once; add it after constrain resolves the sum")
    bias_spec = P(ys.axes_of(y.dim() - 1) or None)
    return local_map(torch.add, (None, bias_spec), ys, check_shapes=False)(y, b)


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, DTensor):
        return x @ w
    x = collective_matmul.materialized(x)  # a deferred row-parallel output read here: computed
    mesh = w.device_mesh
    xs, ws = spec_of(x), spec_of(w)
    w_in, w_out = ws.axes_of(0), ws.axes_of(1)
    if ws.partial:
        raise ValueError(f"linear: the weight must not hold a pending sum (spec {ws})")
    if xs.axes_of(x.dim() - 1) != w_in:
        # Bring x's contracted dim to the weight's split (recorded, autograd-correct).
        x = reshard(x, P(*[xs.axes_of(d) or None for d in range(x.dim() - 1)], w_in or None, partial=xs.partial))
        xs = spec_of(x)
    lead = [xs.axes_of(d) for d in range(x.dim() - 1)]
    lead_axes = tuple(a for axes in lead for a in axes)
    clash = set(w_out) & (set(lead_axes) | set(xs.partial))
    if clash:
        raise ValueError(f"linear: mesh axes {sorted(clash)} split both the input {xs} and the weight's output {ws}")
    # Gradients (local_map's rule): x's is a pending sum over w's output split (each rank
    # holds some columns); w's over everything that splits x's rows, and x's own
    # pending-sum terms. The output's shape follows from the checked specs: no shape check.
    spec = P(*[a or None for a in lead], w_out or None, partial=_ordered(mesh, xs.partial + w_in))
    # Async tp (dtp.ops.collective_matmul): the block entry's ring runs under its first
    # consumer's matmul; a row-parallel output waits for constrain's dual ring.
    ring = collective_matmul.ring_linear(x, w, spec)
    if ring is not None:
        return ring
    if collective_matmul.defers(x, w_in):
        return collective_matmul.deferred(x, w, spec)
    return local_map(torch.matmul, (None, None), spec, check_shapes=False)(x, w)


def embedding(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Look ``tokens`` (batch, seq) up in ``table`` (vocab, embed).

    With the vocab split over mesh axes, each rank looks up the ids in its own range and
    zeros the rest: the result is a pending sum over those axes.

    >>> embedding(torch.randn(256, 8), torch.tensor([[1, 2]])).shape
    torch.Size([1, 2, 8])
    """
    if not isinstance(table, DTensor):
        return F.embedding(tokens, table)
    mesh = table.device_mesh
    tspec, kspec = spec_of(table), spec_of(tokens)
    vocab_axes = tspec.axes_of(0)
    if tspec.axes_of(1):
        raise ValueError(f"embedding: the embed dim of the table must not be split (table spec {tspec})")
    # Each rank's table gradient sums over its own tokens: local_map reads it as pending
    # over the token axes the table is not split over.

    def lookup(t_local: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        v_local = t_local.shape[0]
        offset = _vocab_offset(mesh, vocab_axes, v_local)
        mine = (ids >= offset) & (ids < offset + v_local)
        return F.embedding((ids - offset).clamp(0, v_local - 1), t_local) * mine.unsqueeze(-1).to(t_local.dtype)

    spec = P(kspec.axes_of(0) or None, kspec.axes_of(1) or None, None, partial=vocab_axes)
    return local_map(lookup, (None, None), spec, check_shapes=False)(table, tokens)


def count_targets(targets: torch.Tensor) -> int:
    """The valid targets (not :data:`IGNORE_INDEX`) of the global ``targets``.

    On a DTensor each rank counts its shard and the counts are summed over the mesh
    axes that split it: one all-reduce of one int64 per axis (tag ``"loss"``).

    >>> count_targets(torch.tensor([[3, -100, 5], [-100, -100, 0]]))
    3
    """
    return int(target_count(targets, post_now=False)()[0])


def target_count(targets: torch.Tensor, *, post_now: bool) -> Callable[[], torch.Tensor]:
    """:func:`count_targets` split in two and kept on the device: with ``post_now`` the
    first all-reduce is posted here, unwaited; the returned function waits for it (and
    runs any further axis's) and gives the count as a one-element int64 tensor on the
    targets' device, never read to the host. ``train_step`` posts the count before
    forward (not where the run schedules itself, as a pipeline does: ``post_now=False``
    runs every all-reduce at the call), divides the first loss by it and reads it with
    the loss and the gradient norm at the step's end: on a GPU no wait for the device in
    the middle of forward.

    >>> target_count(torch.tensor([[3, -100, 5]]), post_now=True)()
    tensor([2])
    """
    if not isinstance(targets, DTensor):  # local batch mode (dtp.ops.local_batch): summed over its axes
        n = (targets != IGNORE_INDEX).sum().reshape(1).to(torch.int64)
        return lambda: batch_sum(n, "loss")
    n = (targets.to_local() != IGNORE_INDEX).sum().reshape(1).to(torch.int64)
    spec, mesh = spec_of(targets), targets.device_mesh
    axes = _ordered(mesh, tuple(a for d in range(targets.dim()) for a in spec.axes_of(d)))
    first = comm.all_reduce(n, mesh, axes[0], async_op=True, tag="loss") if axes and post_now else None

    def finish() -> torch.Tensor:
        total = first.wait() if first is not None else n
        for axis in axes[1:] if first is not None else axes:
            total = comm.all_reduce(total, mesh, axis, tag="loss")
        return total

    return finish


@contextlib.contextmanager
def mean_over(divisor: float | Callable[[], float | DeviceDivisor]) -> Iterator[None]:
    """Inside, :func:`cross_entropy` divides its sum over the valid targets by ``divisor``
    (> 0) instead of counting its own targets. A callable is called once, by the first
    cross-entropy inside: ``train_step`` counts the batch's targets there, after forward,
    so the count's all-reduce never waits in front of forward's parameter gathers.

    ``train_step`` sets it to (the valid targets of the step's whole batch) / microbatches:
    each microbatch's loss, weighted 1/m, then adds up to the one global mean (Hugging
    Face's ``num_items_in_batch``, torchtitan's global valid-token count); the MoE aux
    losses keep their 1/m weight.

    >>> logits, targets = torch.zeros(1, 2, 4), torch.tensor([[0, -100]])
    >>> with mean_over(2.0):
    ...     round(float(cross_entropy(logits, targets)), 4)   # log(4) / 2
    0.6931
    """
    previous = getattr(_divisor, "value", None)
    _divisor.value = [divisor]
    try:
        yield
    finally:
        _divisor.value = previous


def mean_over_here() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """What another thread enters to see this thread's :func:`mean_over`: the same
    divisor, counted once whichever thread's cross-entropy asks first (the microbatch
    lanes of ``layouts.expert(ep_overlap=True)`` run the loss off the step's thread).

    >>> import threading
    >>> seen = []
    >>> def lane(carry):
    ...     with carry():
    ...         seen.append(_active_divisor())
    >>> with mean_over(2.0):
    ...     t = threading.Thread(target=lane, args=(mean_over_here(),))
    ...     t.start(); t.join()
    >>> seen
    [2.0]
    """
    held = getattr(_divisor, "value", None)

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        previous = getattr(_divisor, "value", None)
        _divisor.value = held
        try:
            yield
        finally:
            _divisor.value = previous

    return enter


class DeviceDivisor(NamedTuple):
    """``train_step``'s divisor for :func:`mean_over`: (valid targets, at least 1) / m as
    a float64 tensor on the device, > 0 by construction, so it is never read to the host
    to be checked. Any other divisor (a number, a tensor) is read and checked."""

    value: torch.Tensor


def _active_divisor() -> float | torch.Tensor | None:
    """The divisor set by :func:`mean_over` (a callable's called once, here): a float,
    or the device tensor of a :class:`DeviceDivisor`."""
    held = getattr(_divisor, "value", None)
    if held is None:
        return None
    if callable(held[0]):
        held[0] = held[0]()
    if isinstance(held[0], DeviceDivisor):
        return held[0].value
    if not held[0] > 0:
        raise ValueError(f"mean_over: divisor must be > 0, got {held[0]!r}")
    return float(held[0])


def _divide(total: torch.Tensor, divisor: float | torch.Tensor) -> torch.Tensor:
    """``total / divisor`` in ``total``'s dtype: a 0-dim tensor divisor of another dtype
    would promote a 0-dim ``total`` (fp64 over fp32); cast, it divides to the bits a
    Python float divisor gives (both are rounded to ``total``'s dtype first)."""
    if isinstance(divisor, torch.Tensor):
        return total / divisor.to(total.dtype).reshape(())
    return total / divisor


class _SummedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(x, t, ignore_index=IGNORE_INDEX, reduction="sum")`` with the same
    kernels, forward and backward (bitwise: ``tests/test_ops.py``), but a backward that
    writes the logits' gradient into the buffer of the gradient it comes from.

    Autograd's own backward holds three logits-sized tensors at once — the saved
    log-softmax, ``nll_loss``'s dense gradient and log-softmax's gradient — and that is
    where a ZeRO-3 step of llama "tiny" peaks (rank 0, 512 KiB each of 6.2 MiB allocated
    in the step, torch 2.13 CPU). Log-softmax's backward reads each element of its
    incoming gradient once, after the row's sum, and writes the same element, so it runs
    in place: two at once. CPU only (checked there); elsewhere the out-of-place kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logsm = torch.log_softmax(x, -1)
        ctx.save_for_backward(logsm, t)
        return F.nll_loss(logsm, t, ignore_index=IGNORE_INDEX, reduction="sum")

    @staticmethod
    @once_differentiable  # say so if asked for a second derivative, rather than a silent zero
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        logsm, t = ctx.saved_tensors
        aten = torch.ops.aten
        total_weight = torch.zeros((), dtype=logsm.dtype, device=logsm.device)  # unused by reduction="sum"
        grad = aten.nll_loss_backward(g, logsm, t, None, 2, IGNORE_INDEX, total_weight)  # 2: sum
        if grad.device.type != "cpu":
            return aten._log_softmax_backward_data(grad, logsm, -1, logsm.dtype), None
        return aten._log_softmax_backward_data.out(grad, logsm, -1, logsm.dtype, out=grad), None


def _summed_cross_entropy(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy of rows ``x`` (tokens, vocab) against ``t``; traced
    regions get torch's own (the in-place backward is an eager-memory measure)."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not x.requires_grad:
        return F.cross_entropy(x, t, ignore_index=IGNORE_INDEX, reduction="sum")
    return _SummedCrossEntropy.apply(x, t)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of ``logits`` (batch, seq, vocab) against ``targets``.

    Computed in fp32 (fp64 stays fp64). With the vocab split, the full logits are never
    gathered; with the batch/sequence split, the mean is over the global count of valid
    targets (:func:`count_targets`; under :func:`mean_over`, its divisor). Targets equal
    to :data:`IGNORE_INDEX` add nothing; with no valid target the loss is 0. The result is
    a replicated scalar.

    >>> float(cross_entropy(torch.zeros(1, 2, 4), torch.tensor([[0, 3]])))  # log(4)
    1.3862943649291992
    >>> float(cross_entropy(torch.zeros(1, 2, 4), torch.tensor([[0, -100]])))  # one valid target
    1.3862943649291992
    """
    acc = accum_dtype(logits.dtype)
    divisor = _active_divisor()
    if divisor is None:
        divisor = max(count_targets(targets), 1)  # nothing to learn from: 0, not 0/0
    if not isinstance(logits, DTensor):
        total = _summed_cross_entropy(logits.reshape(-1, logits.shape[-1]).to(acc), targets.reshape(-1))
        # One rank's rows in local batch mode: its term of the global mean, summed over the
        # batch axes as a DTensor's pending sum would be (same all-reduce; identity backward).
        return batch_sum(_divide(total, divisor).reshape(1), "loss").reshape(())
    mesh = logits.device_mesh
    lspec, tspec = spec_of(logits), spec_of(targets)
    tok_dims = (lspec.axes_of(0), lspec.axes_of(1))
    if (tspec.axes_of(0), tspec.axes_of(1)) != tok_dims:
        raise ValueError(f"cross_entropy: targets spec {tspec} must split batch/seq like the logits {lspec}")
    vocab_axes = lspec.axes_of(2)

    def sums(logits_local: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = logits_local.to(acc)
        with torch.no_grad():  # any per-token constant keeps exp() in range; the max is the best
            m = local.max(dim=-1).values
            for a in vocab_axes:
                m = comm.all_reduce(m, mesh, a, op="max", tag="cross_entropy max")
        shifted = local - m.unsqueeze(-1)
        v_local = local.shape[-1]
        offset = _vocab_offset(mesh, vocab_axes, v_local)
        mine = (ids >= offset) & (ids < offset + v_local)  # IGNORE_INDEX is no rank's
        picked = shifted.gather(-1, (ids - offset).clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * mine
        return torch.stack([shifted.exp().sum(-1), picked], dim=-1)

    def total(pair: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        per_token = torch.where(ids != IGNORE_INDEX, pair[..., 0].log() - pair[..., 1], 0.0)
        return _divide(per_token.sum(), divisor)

    tok = P(tok_dims[0] or None, tok_dims[1] or None)
    pair = local_map(sums, (None, None), P(*tok.dims, None, partial=vocab_axes), check_shapes=False)(logits, targets)
    # One exchange of two scalars per token over the vocab axes: (sum of exp, target logit).
    pair = reshard(pair, P(*tok.dims, None), tag="cross_entropy")
    token_axes = _ordered(mesh, tok_dims[0] + tok_dims[1])
    loss = local_map(total, (None, None), P(partial=token_axes), check_shapes=False)(pair, targets)
    return reshard(loss, P(), tag="loss")
