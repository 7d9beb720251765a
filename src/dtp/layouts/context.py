"""The context-parallel preset, its options, and the sequence order it implies.

Pure permutations (no collectives) live here too: with zigzag load balancing rank r of cp
holds sequence chunks r and 2·cp−1−r; "cp order" is the global sequence with every
rank's local chunks next to each other, so a contiguous split over cp gives each rank its
part. :meth:`Layout.to_cp_order` applies the layout's choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the CLI checks layouts before torch is imported (core.py)
    import torch
    from torch.distributed.device_mesh import DeviceMesh

from ..core._rules import is_positive_int
from ..core.mesh.shape import axis_names
from .core import Layout, current
from .option import Option, choose, said, setting

__all__ = [
    "CP_ALGORITHMS", "LOAD_BALANCE", "ContextOptions", "context", "context_options", "attended_kv_heads",
    "zigzag_permutation", "cp_permutation", "to_cp_order", "from_cp_order", "check_cp", "check_divisible",
    "check_load_balance", "check_window", "balanced_order", "document_order", "reorder",
]

CpAlgorithm = Literal["ulysses", "ring", "double_ring", "hybrid"]
CP_ALGORITHMS: tuple[CpAlgorithm, ...] = ("ulysses", "ring", "double_ring", "hybrid")
LoadBalance = Literal["zigzag", None]
LOAD_BALANCE: tuple[LoadBalance, ...] = ("zigzag", None)


def check_load_balance(load_balance: str | None, what: str = "") -> None:
    """``ValueError`` unless ``load_balance`` is one of :data:`LOAD_BALANCE`; ``what``
    (the API, e.g. ``"layouts.context"``) starts the message when given."""
    if load_balance not in LOAD_BALANCE:
        raise ValueError(f"{what + ': ' if what else ''}load_balance must be 'zigzag' or None, got {load_balance!r}")


def attended_kv_heads(kv_local: int, degree: int) -> int:
    """The kv heads a rank attends with when its ``kv_local`` heads are split over a
    Ulysses group of ``degree`` ranks (1: no split): fewer heads than the degree are
    repeated up to it first, so each rank gets one.

    >>> attended_kv_heads(8, 2), attended_kv_heads(2, 4), attended_kv_heads(4, 1)
    (4, 1, 4)
    """
    return max(kv_local, degree) // degree


@dataclass(frozen=True, kw_only=True)
class ContextOptions(Option):
    """How ``dtp.ops.attention`` runs when the sequence is split over ``axis``.

    Arguments are checked when it is built; :meth:`check` adds the rules that need the
    mesh and the model's sizes (MindSpeed's), before any collective runs.

    >>> ContextOptions(algo="hybrid", ulysses_degree=2).algo
    'hybrid'
    >>> ContextOptions(algo="double_ring")
    Traceback (most recent call last):
    ...
    ValueError: layouts.context: double_ring needs window > 1 (window=1 is the plain ring: use algo='ring')
    """

    family = "context"
    requires_axes = True

    algo: CpAlgorithm = "ring"  # one of CP_ALGORITHMS (table in dtp.ops.context)
    window: int = 1  # double_ring / hybrid: ranks per inner ring (--cp-window-size); 1: one ring
    ulysses_degree: int = 1  # hybrid: ranks per Ulysses group (--ulysses-degree-in-cp)
    load_balance: LoadBalance = "zigzag"  # "zigzag": rank r holds chunks r and 2·cp−1−r; None: contiguous
    head_chunks: int | None = None  # heads run in this many chunks; None: dtp.ops.context.default_chunks
    axis: str = "cp"  # the mesh axis the sequence is split over

    def __post_init__(self) -> None:
        if self.algo not in CP_ALGORITHMS:
            raise ValueError(f"layouts.context: algo must be one of {CP_ALGORITHMS}, got {self.algo!r}")
        for name, value in (("window", self.window), ("ulysses_degree", self.ulysses_degree),
                            ("head_chunks", 1 if self.head_chunks is None else self.head_chunks)):
            if not is_positive_int(value):
                raise ValueError(f"layouts.context: {name} must be an integer >= 1, got {value!r}")
        check_load_balance(self.load_balance, "layouts.context")
        if self.algo == "double_ring":
            check_window(self.window, None, algo="double_ring")  # the part that needs no mesh
        if self.algo == "hybrid" and self.ulysses_degree == 1:
            raise ValueError("layouts.context: hybrid needs ulysses_degree > 1 (ulysses_degree=1 is the ring)")

    def degree(self, mesh: DeviceMesh) -> int:
        """The size of ``axis`` on ``mesh``, 1 where the mesh has no such axis."""
        names = axis_names(mesh)
        return mesh.size(names.index(self.axis)) if self.axis in names else 1

    def check_sizes(self, sizes: Mapping[str, int], mesh: DeviceMesh, layout: Layout, *, what: str,
                    names: Mapping[str, str] | None) -> None:
        self.check(sizes, mesh, tp=layout.degree("heads", mesh), what=what, names=names)

    def check_batch(self, what: str, key: str, shape: Sequence[int], layout: Layout, mesh: DeviceMesh, *,
                    microbatches: int = 1) -> None:
        """A (batch, seq, …) entry's global seq must cut into this layout's chunks (2·cp
        for zigzag): said where the batch enters, naming the entry, not deep in the model."""
        cp = self.degree(mesh)
        if cp > 1 and len(shape) > 1:
            check_divisible(shape[1], cp, self.load_balance, what=f"{what}: batch[{key!r}] of shape {tuple(shape)}")

    def arrange_batch(self, batch: dict[str, Any], layout: Layout, mesh: DeviceMesh) -> dict[str, Any]:
        """Each (batch, seq, …) entry's sequence in cp order: zigzag's chunks (rank r's r
        and 2·cp−1−r side by side), or a packed-document batch's :func:`balanced_order`
        (its ``positions`` say each token's place, so any order computes the same).
        Every entry moves alike, so the mean loss is unchanged."""
        order = document_order(batch, self.degree(mesh))
        return {k: (self.to_cp_order(v, 1, mesh) if order is None else reorder(v, order)) if v.dim() > 1 else v
                for k, v in batch.items()}

    def check_arranged(self, what: str, key: str, value: Any, arranged: bool, batch: Mapping[str, Any],
                       layout: Layout, mesh: DeviceMesh) -> None:
        """``ValueError`` when, under zigzag on cp > 1, a placed (batch, seq) entry of a
        batch ``dtp.shard_batch`` did not place: the order is in the values, not the
        placement (a hand-placed ``dtp.shard(tokens, mesh, P(None, "cp"))`` has
        shard_batch's spec, yet trained silently on a permuted sequence; RoPE and the
        causal mask read the layout's order). Packed documents carry their order as data
        (``positions``) and run in any."""
        cp = self.degree(mesh)
        if arranged or self.load_balance is None or cp == 1 or "positions" in batch:
            return
        if hasattr(value, "device_mesh") and value.dim() > 1:  # a DTensor the layout did not place
            raise ValueError(
                f"{what}: batch[{key!r}] was not placed by dtp.shard_batch: under layouts.context("
                f"load_balance={self.load_balance!r}) on cp={cp} the sequence must be in the layout's order "
                f"(rank r holds chunks r and {2 * cp - 1}-r), which no placement shows; place the global batch "
                f"with dtp.shard_batch(batch, state)")

    def check(self, sizes: Mapping[str, int], mesh: DeviceMesh, *, tp: int = 1, what: str = "model",
              names: Mapping[str, str] | None = None) -> None:
        """MindSpeed's context-parallel rules for a model of these logical axis ``sizes``.

        ``tp`` is how many ways the layout splits ``heads`` besides cp. Raises:
        ``ValueError`` (starting with ``what``) when cp does not divide by the Ulysses
        degree with a ring left over (hybrid), the window does not divide the ring,
        heads do not divide by Ulysses degree × tp, or ``head_chunks`` does not divide
        the kv heads a rank attends with. Nothing to check without ``axis`` on ``mesh``.
        ``names``: the caller's words for the fields and axes (:func:`~.option.setting`).
        """
        if self.axis not in axis_names(mesh):
            return
        cp, algo, window, u = self.degree(mesh), self.algo, self.window, self.ulysses_degree
        heads = sizes.get("heads")
        if algo == "hybrid":
            if cp % u or cp // u < 2:
                valid = [d for d in range(2, cp // 2 + 1) if cp % d == 0 and cp // d > 1]
                degree_name = said(names, "ulysses_degree")
                fix = (f"valid {degree_name} at cp={cp}: {valid}" if valid
                       else f"cp={cp} has no such {degree_name}: use {setting(names, 'algo', 'ulysses', 'ring')}")
                raise ValueError(f"{what}: hybrid context parallel needs cp={cp} divisible by "
                                 f"{setting(names, 'ulysses_degree', u)} with a ring degree cp/{degree_name} > 1 "
                                 f"(got {cp / u:g}); {fix}")
            ring = cp // u
        else:
            ring = cp
        if algo in ("double_ring", "hybrid"):
            check_window(window, ring, algo=algo, what=what, names=names,
                         of="cp" if algo == "double_ring" else f"the ring degree cp/{said(names, 'ulysses_degree')}")
        degree = {"ulysses": cp, "hybrid": u}.get(algo)
        if degree and heads is not None and heads % (degree * tp):
            smaller = said(names, "cp" if algo == "ulysses" else "ulysses_degree") + \
                (f" or {said(names, 'tp')}" if tp > 1 else "")
            raise ValueError(f"{what}: heads={heads} must be divisible by the Ulysses degree {degree} × tp={tp} "
                             f"= {degree * tp} for {algo} context parallel; {choose(names, 'heads', degree * tp)}, "
                             f"or a smaller {smaller}, or {setting(names, 'algo', 'ring')}")
        chunks, kv = self.head_chunks, sizes.get("kv_heads")
        if chunks is not None and kv is not None and kv % tp == 0:
            per_rank = attended_kv_heads(kv // tp, degree or 1)
            if per_rank % chunks:
                raise ValueError(f"{what}: {setting(names, 'head_chunks', chunks)} must divide the {per_rank} kv heads each rank "
                                 f"attends with (kv_heads={kv}, tp={tp}"
                                 f"{f', Ulysses degree {degree}' if degree else ''})")

    def to_cp_order(self, x: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
        """:func:`to_cp_order` with this degree and load balance; ``x`` itself when there is
        nothing to reorder (cp of 1, or contiguous shards)."""
        cp = self.degree(mesh)
        return x if cp == 1 or self.load_balance is None else to_cp_order(x, dim, cp, self.load_balance)

    def from_cp_order(self, x: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
        """Inverse of :meth:`to_cp_order`."""
        cp = self.degree(mesh)
        return x if cp == 1 or self.load_balance is None else from_cp_order(x, dim, cp, self.load_balance)


def context(algo: CpAlgorithm = ContextOptions.algo, **options: object) -> Layout:
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
    Megatron's / MindSpeed's schedule. Options and defaults: :class:`ContextOptions`.

    >>> context("hybrid", ulysses_degree=2).context.algo
    'hybrid'
    """
    opts = ContextOptions(algo=algo, **options)
    return Layout({}, {"seq": (opts.axis,), "res_seq": (opts.axis,)}, context=opts, name=f"context({opts.algo})")


# Without context parallel in the active layout: one contiguous ring (what a sequence split
# over some axis with no layout asking for anything else gets).
_NO_CONTEXT = ContextOptions(load_balance=None)


def context_options() -> ContextOptions:
    """The active layout's context-parallel options (a contiguous ring without one).

    >>> context_options().algo, context_options().load_balance
    ('ring', None)
    """
    active = current()
    opts = active[0].context if active else None
    return _NO_CONTEXT if opts is None else opts


def check_cp(cp: int) -> None:
    """``ValueError`` unless ``cp`` is a positive int (a context-parallel degree).

    >>> check_cp(0)
    Traceback (most recent call last):
    ...
    ValueError: cp must be a positive int, got 0
    """
    if not is_positive_int(cp):
        raise ValueError(f"cp must be a positive int, got {cp!r}")


def check_window(window: object, ring: int | None, *, algo: str = "double_ring", what: str = "layouts.context",
                 of: str = "cp", names: Mapping[str, str] | None = None) -> int:
    """The one rule for a ring's ``window`` (MindSpeed's ``--cp-window-size``); returns it.

    * ``double_ring``: ``1 < window < cp`` and ``cp % window == 0`` — windows of one are
      the plain ring, one window of all cp ranks is the plain ring too. So a cp with no
      divisor strictly between 1 and itself (2, 3, 5 …) has no double ring: use ``ring``.
    * ``hybrid``: ``1 <= window < R`` dividing the ring degree ``R = cp / ulysses_degree``
      (1: a plain ring of ``R``).

    ``ring`` is that degree, or ``None`` where the mesh is not known yet (then only what
    needs no mesh is checked). ``what`` starts the message, ``of`` names the degree,
    ``names`` are the caller's words for the fields (:func:`~.option.setting`).
    :class:`ContextOptions` and the attention ops (:mod:`dtp.ops.context`) both check
    through here, before any collective.

    >>> check_window(2, 4)
    2
    >>> check_window(2, 2)
    Traceback (most recent call last):
    ...
    ValueError: layouts.context: double_ring needs window > 1, window < cp and cp divisible by window; cp=2 has no such window (got window=2): use algo='ring'
    """
    w, ring_algo = said(names, "window"), setting(names, "algo", "ring")
    if not is_positive_int(window):
        raise ValueError(f"{what}: {w} must be an integer >= 1, got {window!r}")
    if algo == "double_ring":
        if window == 1:
            raise ValueError(f"{what}: double_ring needs {w} > 1 ({setting(names, 'window', 1)} is the plain ring: "
                             f"use {ring_algo})")
        if ring is not None and (window >= ring or ring % window):
            valid = [v for v in range(2, ring) if ring % v == 0]
            rule = f"{what}: double_ring needs {w} > 1, {w} < {of} and {of} divisible by {w}"
            if valid:
                raise ValueError(f"{rule}; got {setting(names, 'window', window)} at {of}={ring} (valid: {valid})")
            raise ValueError(f"{rule}; {of}={ring} has no such {w} (got {setting(names, 'window', window)}): use "
                             f"{ring_algo}")
    elif ring is not None and (window >= ring or ring % window):
        valid = [v for v in range(1, ring) if ring % v == 0]
        raise ValueError(f"{what}: {setting(names, 'window', window)} must be in [1, {ring}) and divide {of}={ring} "
                         f"(valid: {valid})")
    return window  # type: ignore[return-value]


def check_divisible(seq_len: int, cp: int, load_balance: str | None, what: str = "") -> None:
    """``ValueError`` unless ``seq_len`` splits into ``cp`` (zigzag: ``2·cp``) equal chunks;
    ``what`` (the API and tensor, e.g. ``"shard_batch: batch['tokens']"``) starts the
    message when given."""
    start = what + ": " if what else ""
    if load_balance == "zigzag":
        if seq_len % (2 * cp) != 0:
            raise ValueError(
                f"{start}zigzag load balancing cuts the sequence into 2*cp chunks, so seq_len must "
                f"be divisible by 2*cp; got seq_len={seq_len}, cp={cp} "
                f"(seq_len % {2 * cp} = {seq_len % (2 * cp)}); valid: seq_len a multiple of {2 * cp} "
                f"(load_balance=None needs a multiple of {cp})"
            )
    elif seq_len % cp != 0:
        raise ValueError(
            f"{start}context parallelism splits the sequence into cp equal parts, so seq_len must "
            f"be divisible by cp; got seq_len={seq_len}, cp={cp}; valid: seq_len a multiple of {cp}"
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
    check_cp(cp)
    check_divisible(seq_len, cp, "zigzag")
    c = seq_len // (2 * cp)
    import torch

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
    check_cp(cp)
    check_load_balance(load_balance)
    check_divisible(seq_len, cp, load_balance)
    if load_balance == "zigzag":
        return zigzag_permutation(seq_len, cp, device=device)
    import torch

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
    import torch

    return x if load_balance is None else x.index_select(dim, torch.argsort(perm))


def _chunks_per_rank(local: int, most: int = 16) -> int:
    return max(c for c in range(1, min(local, most) + 1) if local % c == 0)


def balanced_order(positions: torch.Tensor, cp: int, chunks: int | None = None) -> torch.Tensor:
    """Per row, the order (indices into the sequence) that deals ``cp * chunks`` equal
    contiguous chunks to the cp ranks (rank ``r`` holds entries ``[r·s/cp, (r+1)·s/cp)``
    of the order), each rank ``chunks`` of them, balancing the attended pairs
    (``Σ positions + 1`` over a rank's queries): largest chunk first to the least-loaded
    rank with room (greedy LPT). A rank's chunks keep their original order. ``chunks``
    defaults to the largest divisor of ``s/cp`` up to 16.

    >>> pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    >>> balanced_order(pos, 2, chunks=2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    import torch  # here: the layouts import without torch (the CLI checks a run before it loads)

    b, s = positions.shape
    if cp < 1 or s % cp:
        raise ValueError(f"balanced_order: seq={s} must divide by cp={cp}")
    local = s // cp
    k = _chunks_per_rank(local) if chunks is None else chunks
    if k < 1 or local % k:
        raise ValueError(f"balanced_order: chunks={k} must divide the {local} tokens per rank")
    size = local // k
    weight = (positions.to(torch.float64) + 1).view(b, cp * k, size).sum(-1)
    rows = []
    for r in range(b):
        load, owned = [0.0] * cp, [[] for _ in range(cp)]
        for c in torch.argsort(weight[r], descending=True, stable=True).tolist():
            dst = min((i for i in range(cp) if len(owned[i]) < k), key=lambda i: load[i])
            owned[dst].append(c)
            load[dst] += float(weight[r, c])
        picked = torch.tensor([c for o in owned for c in sorted(o)], dtype=torch.int64)
        rows.append((picked[:, None] * size + torch.arange(size)).reshape(-1))
    return torch.stack(rows).to(positions.device)


def document_order(batch: Mapping[str, torch.Tensor], cp: int) -> torch.Tensor | None:
    """The sequence order ``shard_batch`` gives a packed-document batch under ``cp > 1``
    (:func:`balanced_order` of its ``positions``); ``None`` for any other batch, which
    keeps the layout's fixed order.

    >>> document_order({"tokens": torch.zeros(1, 4)}, 2) is None
    True
    """
    if cp <= 1 or "positions" not in batch:
        return None
    return balanced_order(batch["positions"], cp)


def reorder(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x`` (``(batch, seq, ...)``) with each row's sequence in ``order`` (``(batch, seq)``).

    >>> reorder(torch.tensor([[10, 11, 12]]), torch.tensor([[2, 0, 1]])).tolist()
    [[12, 10, 11]]
    """
    import torch  # here: as above

    index = order.view(*order.shape, *([1] * (x.dim() - 2))).expand(*order.shape, *x.shape[2:])
    return torch.gather(x, 1, index.to(x.device))
