"""Layouts: rules from logical axis names to mesh axes (Flax / MaxText style).

Model code names its axes — a weight is ``("embed", "mlp")``, an activation
``("batch", "seq", "embed")`` — and a :class:`Layout` decides where each lives. A layout
knows two mappings, like Levanter's: where **parameters** rest (and where optimizer
state lives) and where **activations** are computed. Presets compose with ``+``::

    layout = layouts.data() + layouts.megatron(sequence_parallel=True)

Composition rules:

* a logical axis mapped by several presets is split over all their mesh axes, ordered
  by *mesh order* when resolved (``seq`` on ``cp`` and, with SP, ``tp`` gives
  ``("cp", "tp")`` on a ``dp×cp×tp`` mesh — Megatron's CP-outer, SP-inner split);
* mesh axes the mesh does not have are dropped, so one layout serves every mesh;
* within one tensor a mesh axis splits at most one dim: the first logical axis that
  claims it wins (later claims are dropped), as in MaxText.

Logical axes of the reference model:

============  ===================================================================
batch         the batch
seq           sequence where attention / MLP compute happens (cp splits it)
res_seq       sequence in the residual stream: norms, residual adds (cp, and tp with SP)
embed         the model width
heads         query heads (also the flattened heads × head_dim of projections)
kv_heads      key/value heads
mlp           the MLP hidden width
vocab         the vocabulary
head_dim      per-head width (never split)
============  ===================================================================
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..spec import P, _names

__all__ = ["Layout", "data", "megatron", "context", "context_options", "zero", "use_layout", "current", "constrain"]

Axes = tuple[str, ...]


def _merge(a: Mapping[str, Axes], b: Mapping[str, Axes]) -> dict[str, Axes]:
    out = dict(a)
    for k, v in b.items():
        out[k] = tuple(dict.fromkeys(out.get(k, ()) + tuple(v)))
    return out


@dataclass(frozen=True)
class Layout:
    """Logical-axis → mesh-axes rules for parameters and activations, plus options.

    >>> layout = data() + megatron(sequence_parallel=True)
    >>> layout.activations["res_seq"]
    ('tp',)
    """

    params: Mapping[str, Axes] = field(default_factory=dict)
    activations: Mapping[str, Axes] = field(default_factory=dict)
    options: Mapping[str, object] = field(default_factory=dict)
    name: str = ""

    def __add__(self, other: "Layout") -> "Layout":
        if not isinstance(other, Layout):
            return NotImplemented
        return Layout(_merge(self.params, other.params), _merge(self.activations, other.activations),
                      {**self.options, **other.options}, " + ".join(n for n in (self.name, other.name) if n))

    def _spec(self, rules: Mapping[str, Axes], logical: Sequence[str | None], mesh: DeviceMesh) -> P:
        names = _names(mesh)
        used: set[str] = set()
        dims = []
        for ax in logical:
            mesh_axes = [m for m in rules.get(ax, ()) if m in names and m not in used] if ax else []
            mesh_axes.sort(key=names.index)
            used.update(mesh_axes)
            dims.append(tuple(mesh_axes) or None)
        return P(*dims)

    def param_spec(self, logical: Sequence[str | None], mesh: DeviceMesh) -> P:
        """Where a parameter with these logical axes rests (and its optimizer state)."""
        return self._spec(self.params, logical, mesh)

    def activation_spec(self, logical: Sequence[str | None], mesh: DeviceMesh) -> P:
        """Where an activation with these logical axes is computed."""
        return self._spec(self.activations, logical, mesh)

    def mesh_axes(self, logical: str, mesh: DeviceMesh, *, activation: bool = True) -> Axes:
        """The mesh axes (mesh order) that split one logical axis."""
        spec = self.activation_spec((logical,), mesh) if activation else self.param_spec((logical,), mesh)
        return spec.axes_of(0)

    def degree(self, logical: str, mesh: DeviceMesh, *, activation: bool = True) -> int:
        """How many ways a logical axis is split on this mesh."""
        names = _names(mesh)
        return math.prod(mesh.size(names.index(a)) for a in self.mesh_axes(logical, mesh, activation=activation))

    def context_degree(self, mesh: DeviceMesh) -> int:
        """The context-parallel degree on ``mesh``: the size of the layout's cp axis, or 1
        when the layout has no context parallel or the mesh has no such axis."""
        opts = self.options.get("context")
        names = _names(mesh)
        if not opts or opts["axis"] not in names:
            return 1
        return mesh.size(names.index(opts["axis"]))

    def to_cp_order(self, x: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
        """Put the global sequence along ``dim`` of ``x`` into this layout's cp order.

        The layout owns the permutation: with ``layouts.context(..., load_balance="zigzag")``
        on a mesh with ``cp > 1`` rank r gets chunks r and 2·cp−1−r, so a contiguous split of
        the result over cp gives every rank its local sequence (what :func:`dtp.shard_batch`
        does). Identity without context parallel, with ``cp == 1`` or with
        ``load_balance=None`` (contiguous shards). ``ValueError`` if the sequence length
        does not divide by 2·cp (zigzag) or cp.

        >>> mesh = make_mesh(dp=1, cp=2)                                   # doctest: +SKIP
        >>> context("ring").to_cp_order(torch.arange(8), 0, mesh).tolist()  # doctest: +SKIP
        [0, 1, 6, 7, 2, 3, 4, 5]
        >>> data().to_cp_order(torch.arange(8), 0, mesh).tolist()           # doctest: +SKIP
        [0, 1, 2, 3, 4, 5, 6, 7]
        """
        cp, lb = self.context_degree(mesh), self._load_balance()
        return x if cp == 1 or lb is None else to_cp_order(x, dim, cp, lb)

    def from_cp_order(self, x: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
        """Inverse of :meth:`to_cp_order`: a gathered cp-ordered sequence back to natural order.

        >>> y = layout.to_cp_order(x, 1, mesh)                              # doctest: +SKIP
        >>> torch.equal(layout.from_cp_order(y, 1, mesh), x)               # doctest: +SKIP
        True
        """
        cp, lb = self.context_degree(mesh), self._load_balance()
        return x if cp == 1 or lb is None else from_cp_order(x, dim, cp, lb)

    def _load_balance(self) -> str | None:
        opts = self.options.get("context")
        return opts["load_balance"] if opts else None

    def check_sizes(self, sizes: Mapping[str, int], mesh: DeviceMesh, what: str = "model") -> None:
        """``ValueError`` unless every logical axis size divides by its split, e.g.
        ``heads=6`` on ``tp=4``; raised identically on every rank, before any collective."""
        _check_context(self, sizes, mesh, what)
        for logical, size in sizes.items():
            for activation in (False, True):
                n = self.degree(logical, mesh, activation=activation)
                if size % n:
                    names = _names(mesh)
                    split = " × ".join(f"{a}={mesh.size(names.index(a))}"
                                       for a in self.mesh_axes(logical, mesh, activation=activation))
                    raise ValueError(
                        f"{what}: {logical}={size} is not divisible by {split} = {n} "
                        f"(layout {self.name or 'custom'}); choose {logical} a multiple of {n}, "
                        f"or a smaller {'/'.join(self.mesh_axes(logical, mesh, activation=activation))}"
                    )


def attended_kv_heads(kv_local: int, degree: int) -> int:
    """The kv heads a rank attends with when its ``kv_local`` heads are split over a
    Ulysses group of ``degree`` ranks (1: no split): fewer heads than the degree are
    repeated up to it first, so each rank gets one.

    >>> attended_kv_heads(8, 2), attended_kv_heads(2, 4), attended_kv_heads(4, 1)
    (4, 1, 4)
    """
    return max(kv_local, degree) // degree


def _check_context(layout: Layout, sizes: Mapping[str, int], mesh: DeviceMesh, what: str) -> None:
    """MindSpeed's context-parallel rules, checked before any collective runs."""
    opts = layout.options.get("context")
    if not opts or opts["axis"] not in _names(mesh):
        return
    cp = layout.context_degree(mesh)
    algo, window, u = opts["algo"], opts["window"], opts["ulysses_degree"]
    heads, tp = sizes.get("heads"), layout.degree("heads", mesh)
    if algo == "hybrid":
        if cp % u or cp // u < 2:
            raise ValueError(f"{what}: hybrid context parallel needs cp={cp} divisible by ulysses_degree={u} "
                             f"with a ring degree cp/ulysses_degree > 1 (got {cp / u:g})")
        ring = cp // u
    else:
        ring = cp
    if algo in ("double_ring", "hybrid") and window > 1 and (window >= ring or ring % window):
        raise ValueError(f"{what}: window={window} must be in [1, {ring}) and divide the ring degree {ring} "
                         f"(cp={cp}{f' / ulysses_degree={u}' if algo == 'hybrid' else ''})")
    degree = {"ulysses": cp, "hybrid": u}.get(algo)
    if degree and heads is not None and heads % (degree * tp):
        raise ValueError(f"{what}: heads={heads} must be divisible by the Ulysses degree {degree} × tp={tp} "
                         f"= {degree * tp} for {algo} context parallel")
    chunks, kv = opts.get("head_chunks"), sizes.get("kv_heads")
    if chunks is not None and kv is not None and kv % tp == 0:
        per_rank = attended_kv_heads(kv // tp, degree or 1)
        if per_rank % chunks:
            raise ValueError(f"{what}: head_chunks={chunks} must divide the {per_rank} kv heads each rank attends "
                             f"with (kv_heads={kv}, tp={tp}{f', Ulysses degree {degree}' if degree else ''})")


# ------------------------------------------------------------ sequence order under context parallel
#
# Pure permutations (no collectives). With zigzag load balancing rank r of cp holds
# sequence chunks r and 2·cp−1−r; "cp order" is the global sequence with every rank's
# local chunks next to each other, so a contiguous split over cp gives each rank its
# part. :meth:`Layout.to_cp_order` applies the active layout's choice.


def _check_cp(cp: int) -> None:
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")


def _check_load_balance(load_balance: str | None) -> None:
    if load_balance not in ("zigzag", None):
        raise ValueError(f"load_balance must be 'zigzag' or None, got {load_balance!r}")


def _check_divisible(seq_len: int, cp: int, load_balance: str | None) -> None:
    if load_balance == "zigzag":
        if seq_len % (2 * cp) != 0:
            raise ValueError(
                f"zigzag load balancing cuts the sequence into 2*cp chunks, so seq_len must "
                f"be divisible by 2*cp; got seq_len={seq_len}, cp={cp} "
                f"(seq_len % {2 * cp} = {seq_len % (2 * cp)})"
            )
    elif seq_len % cp != 0:
        raise ValueError(
            f"context parallelism splits the sequence into cp equal parts, so seq_len must "
            f"be divisible by cp; got seq_len={seq_len}, cp={cp}"
        )


def zigzag_permutation(seq_len: int, cp: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions in zigzag cp order.

    The sequence is cut into ``2*cp`` equal chunks and rank ``r`` holds chunks ``r`` and
    ``2*cp-1-r`` (an early, cheap chunk and a late, expensive one, which balances causal
    work). Concatenating every rank's local sequence in rank order gives
    ``x[..., permutation, ...]``.

    Raises:
        ValueError: if ``seq_len % (2*cp) != 0``.

    >>> zigzag_permutation(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    _check_cp(cp)
    _check_divisible(seq_len, cp, "zigzag")
    c = seq_len // (2 * cp)
    chunks = torch.arange(seq_len, device=device).view(2 * cp, c)
    order = [i for r in range(cp) for i in (r, 2 * cp - 1 - r)]
    return chunks[order].reshape(-1)


def cp_permutation(
    seq_len: int, cp: int, load_balance: str | None, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """:func:`zigzag_permutation` for ``"zigzag"``, ``arange(seq_len)`` for ``None``.

    >>> cp_permutation(4, 2, None).tolist()
    [0, 1, 2, 3]
    """
    _check_cp(cp)
    _check_load_balance(load_balance)
    _check_divisible(seq_len, cp, load_balance)
    if load_balance == "zigzag":
        return zigzag_permutation(seq_len, cp, device=device)
    return torch.arange(seq_len, device=device)


def to_cp_order(x: torch.Tensor, dim: int, cp: int, load_balance: str | None = "zigzag") -> torch.Tensor:
    """Reorder ``x`` along ``dim`` from natural order into cp order.

    Afterwards, splitting ``dim`` into ``cp`` equal contiguous parts gives every rank its
    local sequence. ``load_balance=None`` is the identity (contiguous split).

    >>> to_cp_order(torch.arange(8), 0, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    perm = cp_permutation(x.shape[dim], cp, load_balance, device=x.device)
    return x if load_balance is None else x.index_select(dim, perm)


def from_cp_order(x: torch.Tensor, dim: int, cp: int, load_balance: str | None = "zigzag") -> torch.Tensor:
    """Inverse of :func:`to_cp_order`.

    >>> x = torch.arange(12)
    >>> bool((from_cp_order(to_cp_order(x, 0, 3), 0, 3) == x).all())
    True
    """
    perm = cp_permutation(x.shape[dim], cp, load_balance, device=x.device)
    return x if load_balance is None else x.index_select(dim, torch.argsort(perm))


def data(axis: str = "dp") -> Layout:
    """Data parallel: the batch is split over ``axis``; parameters are replicated.

    >>> data().activations["batch"]
    ('dp',)
    """
    return Layout({}, {"batch": (axis,)}, {}, "data")


def megatron(sequence_parallel: bool = False, axis: str = "tp") -> Layout:
    """Megatron tensor parallel over ``axis`` (optionally with sequence parallel).

    Column-parallel QKV / gate / up (output features on ``tp``), row-parallel output /
    down projections (input features on ``tp``), heads on ``tp``, a vocab-parallel
    embedding and cross-entropy. With ``sequence_parallel`` the residual stream (norms,
    residual adds) is split on sequence over ``tp``; entering a block is then an
    all-gather and leaving it a reduce-scatter, exactly Megatron-SP's collectives.

    >>> megatron(sequence_parallel=True).activations["res_seq"]
    ('tp',)
    """
    shard = {"heads": (axis,), "kv_heads": (axis,), "mlp": (axis,), "vocab": (axis,)}
    acts = dict(shard)
    if sequence_parallel:
        acts["res_seq"] = (axis,)
    return Layout(shard, acts, {"sequence_parallel": sequence_parallel},
                  f"megatron(sequence_parallel={sequence_parallel})")


CONTEXT_ALGORITHMS = ("ulysses", "ring", "double_ring", "hybrid")


def context(algo: str = "ring", *, window: int = 1, ulysses_degree: int = 1,
            load_balance: str | None = "zigzag", head_chunks: int | None = None, axis: str = "cp") -> Layout:
    """Context parallel over ``axis``: the sequence is split everywhere (residual stream
    and attention) and ``dtp.ops.attention`` runs MindSpeed's algorithm ``algo``:

    * ``"ulysses"`` — all-to-all from a sequence split to a head split and back
      (heads must divide by tp × cp);
    * ``"ring"`` — K/V blocks rotate round the ring, overlapped with compute;
    * ``"double_ring"`` — an inner ring inside windows of ``window`` ranks, an outer ring
      across windows (``--cp-window-size``);
    * ``"hybrid"`` — Ulysses over groups of ``ulysses_degree`` contiguous ranks, ring
      (or double ring with ``window``) over the rest (``--ulysses-degree-in-cp``).

    ``load_balance="zigzag"`` gives rank r sequence chunks r and 2·cp−1−r, so causal work
    is even; :func:`dtp.shard_batch` puts batches in that order and RoPE follows the
    original positions. Constraints involving the mesh (window dividing cp, sequence
    divisible by 2·cp, heads by the Ulysses degree × tp) are checked before any collective.

    ``head_chunks`` runs the attention in that many chunks of heads, one after the
    other. Same result and bytes; a rank's buffers beyond its inputs, output and
    gradients shrink by that factor, for more (smaller) transfers. ``None`` (the
    default, :func:`dtp.ops.context.default_chunks`) takes the fewest chunks, dividing
    the kv heads a rank attends with, such that chunks × cp >= 16, without making a
    chunk's K+V smaller than 1 MiB (small problems run as one chunk); ``1`` is
    Megatron's / MindSpeed's schedule.

    >>> context("hybrid", ulysses_degree=2).options["context"]["algo"]
    'hybrid'
    """
    if algo not in CONTEXT_ALGORITHMS:
        raise ValueError(f"layouts.context: algo must be one of {CONTEXT_ALGORITHMS}, got {algo!r}")
    for name, value in (("window", window), ("ulysses_degree", ulysses_degree),
                        ("head_chunks", 1 if head_chunks is None else head_chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"layouts.context: {name} must be an integer >= 1, got {value!r}")
    if load_balance not in ("zigzag", None):
        raise ValueError(f"layouts.context: load_balance must be 'zigzag' or None, got {load_balance!r}")
    if algo == "double_ring" and window == 1:
        raise ValueError("layouts.context: double_ring needs window > 1 (window=1 is the plain ring)")
    if algo == "hybrid" and ulysses_degree == 1:
        raise ValueError("layouts.context: hybrid needs ulysses_degree > 1 (ulysses_degree=1 is the ring)")
    options = {"algo": algo, "window": window, "ulysses_degree": ulysses_degree, "load_balance": load_balance,
               "head_chunks": head_chunks, "axis": axis}
    rules = {"seq": (axis,), "res_seq": (axis,)}
    return Layout({}, rules, {"context": options}, f"context({algo})")


def zero(stage: int = 1, *, bucket_mb: float = 40.0, overlap_grad_reduce: bool = False,
         overlap_param_gather: bool = False, reshard_after_forward: bool = True, prefetch: int = 1,
         axis: str = "dp") -> Layout:
    """Data parallel with ZeRO over ``axis`` — Megatron's distributed optimizer.

    Parameters (each rank's tensor/sequence-parallel shard of them) are packed into
    contiguous flat buckets of about ``bucket_mb`` MiB, padded so each splits evenly over
    ``axis``; rank r owns slice r of every bucket.

    * ``stage=1``: optimizer state and master weights (fp32 for bf16/fp16 parameters)
      live only on their owner: 1/dp of them per rank. Gradients are reduce-scattered
      per bucket, each rank updates its slice, parameters are all-gathered.
    * ``stage=2``: as 1, and a bucket's full gradient buffer is released as soon as its
      reduce-scatter is done, so only gradient slices outlive backward.
    * ``stage=3``: parameters too rest as slices; forward all-gathers a bucket right
      before its first use (always prefetching the next: ``overlap_param_gather`` is
      implied), backward gathers it again for the saved activations that need it, then
      frees it — 3Ψ of traffic instead of 2Ψ. ``reshard_after_forward=False`` (FSDP2's
      option of that name) keeps every bucket forward gathered until backward is done
      with it: parameters still rest as slices between steps, but a step holds them
      whole from forward to backward, and traffic is 2Ψ (no backward re-gather).
      ``prefetch`` (stage 3) is how many buckets are gathered ahead of the one in use:
      more keeps a slow link busy (the FIFO link of ``benchmarks/zero_overlap.py`` needs
      2-3) at the cost of that many more whole buckets in memory.

    The first step reads the parameters as ``TrainState.create`` laid them out (whole on
    every dp rank) and records their use order; buckets, master slices and optimizer
    state exist from the end of that step on (``state.opt_state`` is ``None`` before).

    ``overlap_grad_reduce`` starts each bucket's reduce-scatter during backward as soon
    as its last gradient is in (on the last microbatch only); ``overlap_param_gather``
    leaves the all-gathers of the update in flight in the returned state, and the next
    forward waits on each bucket right before its first use. Buckets follow the
    parameters' real use order, recorded in the first step's forward (MindSpeed's
    ``--reset-bucket-group-order``), not the order they were created in.

    >>> layout = data() + zero(2, overlap_grad_reduce=True, overlap_param_gather=True)
    >>> layout.options["zero"]["stage"]
    2
    """
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"layouts.zero: stage must be 0, 1, 2 or 3, got {stage!r}")
    if not bucket_mb > 0:
        raise ValueError(f"layouts.zero: bucket_mb must be > 0, got {bucket_mb!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"layouts.zero: prefetch must be an int >= 1, got {prefetch!r}")
    if prefetch != 1 and stage != 3:
        raise ValueError(f"layouts.zero: prefetch is a stage-3 option (stages 1/2 gather every bucket after "
                         f"the update), got stage={stage}")
    if not reshard_after_forward and stage != 3:
        raise ValueError(f"layouts.zero: reshard_after_forward=False is a stage-3 option (stages 1/2 keep "
                         f"parameters whole anyway), got stage={stage}")
    if stage == 0:  # plain data parallel: gradients all-reduced, everything replicated
        return data(axis)
    options = {"stage": stage, "bucket_mb": float(bucket_mb), "overlap_grad_reduce": bool(overlap_grad_reduce),
               "overlap_param_gather": bool(overlap_param_gather), "axis": axis,
               "reshard_after_forward": bool(reshard_after_forward), "prefetch": prefetch}
    return Layout({}, {"batch": (axis,)}, {"zero": options}, f"zero({stage})")


def context_options() -> dict[str, object]:
    """The active layout's context-parallel options (contiguous ring defaults without one)."""
    active = current()
    opts = active[0].options.get("context") if active else None
    return dict(opts) if opts else {"algo": "ring", "window": 1, "ulysses_degree": 1, "load_balance": None,
                                    "head_chunks": None}


_active = threading.local()


def current() -> tuple[Layout, DeviceMesh] | None:
    """The ``(layout, mesh)`` made active by :func:`use_layout`, or ``None``."""
    stack = getattr(_active, "stack", [])
    return stack[-1] if stack else None


@contextlib.contextmanager
def use_layout(layout: Layout, mesh: DeviceMesh) -> Iterator[Layout]:
    """Make ``layout`` on ``mesh`` active (like Flax's ``logical_axis_rules``).

    >>> with use_layout(data(), make_mesh(dp=1)):               # doctest: +SKIP
    ...     h = constrain(h, ("batch", "seq", "embed"))
    """
    if not hasattr(_active, "stack"):
        _active.stack = []
    _active.stack.append((layout, mesh))
    try:
        yield layout
    finally:
        _active.stack.pop()


def constrain(x: torch.Tensor, logical: Sequence[str | None], *, name: str = "activation") -> torch.Tensor:
    """``with_sharding_constraint``: reshard ``x`` to where the active layout puts it.

    Without an active layout (or for a plain tensor) it returns ``x`` unchanged, so the
    same model code runs on one device.

    >>> h = constrain(h, ("batch", "res_seq", "embed"))       # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor

    from ..redistribute import reshard

    active = current()
    if active is None or not isinstance(x, DTensor):
        return x
    layout, mesh = active
    if len(logical) != x.dim():
        raise ValueError(f"{name}: {len(logical)} logical axes {tuple(logical)} for a tensor of shape {tuple(x.shape)}")
    return reshard(x, layout.activation_spec(logical, mesh), name=name, tag=name)
