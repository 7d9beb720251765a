"""The :class:`Layout` itself: rules, composition with ``+``, and the active layout.

The presets that build layouts live one family to a module (:mod:`.megatron`,
:mod:`.context`, :mod:`.zero`, ...); each keeps its options in a frozen dataclass that
checks itself (an :class:`~.option.Option`), and a layout holds those objects as a
collection it iterates: this module names none of them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import math
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence, TypeVar

from ..core.mesh.shape import axis_names
from .option import Option, choose

# torch stays out of the layouts' imports: `dtp train` builds the layout and checks the
# model against it (on a MeshShape) before torch is imported. Only annotations name torch.
if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ..core.spec import P

__all__ = ["Layout", "Axes", "MODEL_AXES", "PlacedBatch", "use_layout", "current", "constrain", "split_in_words"]

Axes = tuple[str, ...]
_T = TypeVar("_T")
# The reference model's logical axes (the table in dtp.layouts). A layout knows these and
# every axis its rules name; any other name is a typo until declared (Layout({name: ()})).
MODEL_AXES: frozenset[str] = frozenset(
    {"batch", "seq", "res_seq", "embed", "heads", "kv_heads", "mlp", "vocab", "head_dim", "expert", "expert_mlp",
     "router"})
_log = logging.getLogger("dtp")
# The mesh axes dtp's presets name (data, megatron, context and its sub-rings, expert,
# pipeline): a rule naming another axis the mesh lacks is worth a warning.
PRESET_MESH_AXES = frozenset({"dp", "tp", "cp", "ep", "pp"})
_said_dropped: set[tuple[str, tuple[str, ...], tuple[str, ...]]] = set()


def _rule(family: str, logical: str, axes: Any) -> Axes:
    """A rule's mesh axes as a tuple: a bare string names one axis, as in ``P("dp")``
    (iterated, ``Layout({"embed": "dp"})`` split it into axes 'd' and 'p').

    >>> _rule("params", "embed", "dp"), _rule("params", "embed", ["dp", "cp"])
    (('dp',), ('dp', 'cp'))
    """
    if isinstance(axes, str):
        return (axes,)
    if isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes):
        return tuple(axes)
    raise TypeError(f"Layout: the {family} rule for {logical!r} must be a mesh axis name or a tuple of them, "
                    f"got {axes!r}")


def _merge(a: Mapping[str, Axes], b: Mapping[str, Axes]) -> dict[str, Axes]:
    out = dict(a)
    for k, v in b.items():
        out[k] = tuple(dict.fromkeys(out.get(k, ()) + tuple(v)))
    return out


def _once(family: str, a: _T | None, b: _T | None, names: tuple[str, str]) -> _T | None:
    """A family's options, set on one side of ``+`` (or the same on both).

    Two different settings of one family are refused: the rules of both sides merge, so
    letting one side's options win would describe another run than the one the rules make
    (``megatron(sequence_parallel=True) + megatron()`` still splits the sequence over tp).

    >>> from dtp.layouts import zero
    >>> (zero(1) + zero(1)).zero.stage
    1
    >>> zero(1) + zero(3)
    Traceback (most recent call last):
    ValueError: layout zero(1) + zero(3): zero is given on both sides (stage=1 vs 3); give it once, with the options you mean
    """
    if a is None:
        return b
    if b is None or a == b:
        return a
    differ = ", ".join(f"{f.name}={getattr(a, f.name)!r} vs {getattr(b, f.name)!r}" for f in fields(a)  # type: ignore[arg-type]
                       if getattr(a, f.name) != getattr(b, f.name))
    raise ValueError(f"layout {names[0] or 'custom'} + {names[1] or 'custom'}: {family} is given on both sides "
                     f"({differ}); give it once, with the options you mean")


def split_in_words(names: Mapping[str, str], axes: Sequence[str], what: str) -> tuple[str, str]:
    """``(why, smaller)`` of a size that does not divide, in a caller's words for the mesh
    axes (``names``, e.g. ``dtp train``'s flags): which of them split ``what``, and what to
    make smaller (:meth:`Layout.check_sizes`, :meth:`~dtp.layouts.ExpertOptions.check`).

    >>> split_in_words({"dp": "--dp", "ep": "--ep"}, ("ep",), "experts")
    ('--ep splits the experts', '--ep')
    """
    said = [names.get(a, a) for a in axes]
    return f"{' and '.join(said)} split{'s' * (len(said) == 1)} the {what}", " or ".join(said)


@dataclass(frozen=True, init=False)
class Layout:
    """Logical-axis → mesh-axes rules for parameters and activations, plus options.

    ``options`` are the presets' typed options (:class:`~dtp.layouts.option.Option`), at
    most one per family, in family order; ``layout.<family>`` is the one of that family
    or ``None`` (``layout.zero``, ``layout.context``, ...). Options may be given as
    ``options=(...)`` or by family, ``Layout(zero=ZeroOptions(stage=1))``.

    >>> from dtp.layouts import data, megatron
    >>> layout = data() + megatron(sequence_parallel=True)
    >>> layout.activations["res_seq"], layout.megatron.sequence_parallel, layout.zero
    (('tp',), True, None)
    >>> [o.family for o in (layout + dtp.layouts.zero(1)).options]
    ['megatron', 'zero']
    """

    params: Mapping[str, Axes]  # where parameters (and optimizer state) rest
    activations: Mapping[str, Axes]  # where activations are computed
    options: tuple[Option, ...]  # the presets' typed options, one per family, sorted by family
    name: str  # for messages: the presets it was composed from

    def __init__(self, params: Mapping[str, Any] | None = None, activations: Mapping[str, Any] | None = None, *,
                 options: Iterable[Option] = (), name: str = "", **by_family: Option | None) -> None:
        held: dict[str, Option] = {}
        for opts in options:
            if not isinstance(opts, Option) or not opts.family:
                raise TypeError(f"Layout: options are layout options (dtp.layouts.option.Option), got {opts!r}")
            held[opts.family] = _once(opts.family, held.get(opts.family), opts, (name, name))
        for family, opts in by_family.items():  # by name: these win (dataclasses.replace(layout, zero=None))
            cls = Option.family_of(family)
            if cls is None:
                raise TypeError(f"Layout: unknown option family {family!r} (known: {', '.join(Option.families())})")
            if opts is not None and not isinstance(opts, cls):
                raise TypeError(f"Layout: {family}= takes a {cls.__name__}, got {type(opts).__name__}")
            held.pop(family, None)
            if opts is not None:
                held[family] = opts
        for family, rules in (("params", params or {}), ("activations", activations or {})):
            object.__setattr__(self, family, {k: _rule(family, k, v) for k, v in rules.items()})
        object.__setattr__(self, "options", tuple(held[f] for f in sorted(held)))
        object.__setattr__(self, "name", name)
        # layout.<family> as a plain attribute for the families known now (the model's hot
        # path reads layout.megatron per block); one registered later goes through __getattr__.
        for family in Option.families():
            object.__setattr__(self, family, held.get(family))

    def __getattr__(self, family: str) -> Option | None:
        # layout.zero, layout.context, ...: only for registered families (a typo still fails).
        if family.startswith("_") or Option.family_of(family) is None:
            raise AttributeError(f"'Layout' object has no attribute {family!r}")
        return self.option(family)

    def option(self, family: str) -> Option | None:
        """The option of ``family`` (``"zero"``), or ``None`` when the layout has none."""
        return next((o for o in self.__dict__.get("options", ()) if o.family == family), None)

    def __add__(self, other: Layout) -> Layout:
        if not isinstance(other, Layout):
            return NotImplemented
        names = (self.name, other.name)
        held = {o.family: o for o in self.options}
        for o in other.options:
            held[o.family] = _once(o.family, held.get(o.family), o, names)
        return Layout(_merge(self.params, other.params), _merge(self.activations, other.activations),
                      options=held.values(), name=" + ".join(n for n in names if n))

    def _spec(self, rules: Mapping[str, Axes], logical: Sequence[str | None], mesh: DeviceMesh, name: str) -> P:
        from ..core.spec import P  # here: see the imports (once torch is loaded, a dict lookup)

        return P(*self._dims(rules, logical, mesh, name))

    def _dims(self, rules: Mapping[str, Axes], logical: Sequence[str | None], mesh: DeviceMesh,
              name: str) -> list[Axes | None]:
        # The spec's entries without the P around them: what the torch-free checks need.
        names = axis_names(mesh)
        used: set[str] = set()
        dims = []
        for ax in logical:
            if ax and ax not in MODEL_AXES and ax not in self.params and ax not in self.activations:
                self._unknown(ax, name)
            mesh_axes = [m for m in rules.get(ax, ()) if m in names and m not in used] if ax else []
            mesh_axes.sort(key=names.index)
            used.update(mesh_axes)
            dims.append(tuple(mesh_axes) or None)
        return dims

    def _unknown(self, ax: str, name: str) -> None:
        known = sorted(MODEL_AXES | set(self.params) | set(self.activations))
        raise ValueError(
            f"{name or 'layout'}: unknown logical axis {ax!r} (layout {self.name or 'custom'}); known: "
            f"{', '.join(known)}. A typo? Otherwise declare it: + dtp.Layout({{{ax!r}: ()}}) keeps it "
            f"replicated, + dtp.Layout({{{ax!r}: ('tp',)}}) splits it"
        )

    def param_spec(self, logical: Sequence[str | None], mesh: DeviceMesh, *, name: str = "") -> P:
        """Where a parameter with these logical axes rests (and its optimizer state).

        Raises ``ValueError`` for a logical axis that is neither a model axis
        (:data:`MODEL_AXES`) nor named by one of the layout's rules (``name`` starts it).
        """
        return self._spec(self.params, logical, mesh, name)

    def activation_spec(self, logical: Sequence[str | None], mesh: DeviceMesh, *, name: str = "") -> P:
        """Where an activation with these logical axes is computed (unknown axes: as
        :meth:`param_spec`)."""
        return self._spec(self.activations, logical, mesh, name)

    def check_mesh(self, mesh: DeviceMesh, what: str = "TrainState.create") -> None:
        """``ValueError`` when an option that needs its mesh axes (``layouts.zero``,
        ``context``, ``pipeline``, ``expert``: :meth:`Option.check_mesh`) names an axis the
        mesh lacks, on a mesh of more than one device: the feature would be silently off.
        The rules of ``data``/``megatron`` (and custom rules) may name absent axes — one
        layout serves every mesh — and those are dropped; which ones is logged once (logger
        ``dtp``, INFO) per layout and mesh.
        """
        names = axis_names(mesh)
        for opts in self.options:
            opts.check_mesh(mesh, what)
        dropped = tuple(sorted({a for rules in (self.params, self.activations) for axes in rules.values()
                                for a in axes if a not in names}))
        key = (self.name, names, dropped)
        if dropped and key not in _said_dropped:
            _said_dropped.add(key)
            _log.info("layout %s on a mesh (%s): rules for mesh axes %s dropped (the mesh lacks them)",
                      self.name or "custom", ", ".join(names), ", ".join(dropped))
            # An axis no preset names is likely a typo ('tpp'): replicating it silently would
            # run something else than was asked, so say so once, louder than INFO.
            strangers = [a for a in dropped if a not in PRESET_MESH_AXES]
            if strangers:
                rules = sorted({ax for r in (self.params, self.activations) for ax, axes in r.items()
                                if set(axes) & set(strangers)})
                warnings.warn(f"layout {self.name or 'custom'}: the rules for {', '.join(map(repr, rules))} name "
                              f"mesh axis {', '.join(map(repr, strangers))}, which no dtp preset uses and this mesh "
                              f"lacks (its axes: {', '.join(names)}); those dims stay replicated. A typo?",
                              UserWarning, stacklevel=3)

    def mesh_axes(self, logical: str, mesh: DeviceMesh, *, activation: bool = True) -> Axes:
        """The mesh axes (mesh order) that split one logical axis."""
        dims = self._dims(self.activations if activation else self.params, (logical,), mesh, "")
        return dims[0] or ()

    def degree(self, logical: str, mesh: DeviceMesh, *, activation: bool = True) -> int:
        """How many ways a logical axis is split on this mesh."""
        names = axis_names(mesh)
        return math.prod(mesh.size(names.index(a)) for a in self.mesh_axes(logical, mesh, activation=activation))

    def context_degree(self, mesh: DeviceMesh) -> int:
        """The context-parallel degree on ``mesh``: the size of the layout's cp axis, or 1
        when the layout has no context parallel or the mesh has no such axis."""
        return 1 if self.context is None else self.context.degree(mesh)

    def to_cp_order(self, x: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
        """Put the global sequence along ``dim`` of ``x`` into this layout's cp order.

        The layout owns the permutation: with ``layouts.context(..., load_balance="zigzag")``
        on a mesh with ``cp > 1`` rank r gets chunks r and 2·cp−1−r, so a contiguous split of
        the result over cp gives every rank its local sequence (what :func:`dtp.shard_batch`
        does). Identity without context parallel, with ``cp == 1`` or with
        ``load_balance=None`` (contiguous shards). ``ValueError`` if the sequence length
        does not divide by 2·cp (zigzag) or cp.

        >>> with simulate(2):
        ...     mesh = make_mesh(dp=1, cp=2)
        ...     dtp.layouts.context("ring").to_cp_order(torch.arange(8), 0, mesh).tolist(), dtp.layouts.data().to_cp_order(torch.arange(8), 0, mesh).tolist()
        ([0, 1, 6, 7, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7])
        """
        return x if self.context is None else self.context.to_cp_order(x, dim, mesh)

    def from_cp_order(self, x: torch.Tensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
        """Inverse of :meth:`to_cp_order`: a gathered cp-ordered sequence back to natural order.

        >>> x, layout = torch.arange(16).view(2, 8), dtp.layouts.context("ring")
        >>> with simulate(2):
        ...     mesh = make_mesh(cp=2)
        ...     torch.equal(layout.from_cp_order(layout.to_cp_order(x, 1, mesh), 1, mesh), x)
        True
        """
        return x if self.context is None else self.context.from_cp_order(x, dim, mesh)

    def check_sizes(self, sizes: Mapping[str, int], mesh: DeviceMesh, what: str = "model", *,
                    names: Mapping[str, str] | None = None) -> None:
        """``ValueError`` unless the model's sizes fit this layout on ``mesh``, raised
        identically on every rank, before any collective.

        Each option present checks its own rules (:meth:`Option.check_sizes`:
        :meth:`ContextOptions.check`, :meth:`ExpertOptions.check`, ...); then every
        logical axis size must divide by its split,
        e.g. ``heads=6`` on ``tp=4`` fails. ``what`` starts the messages; ``names``, what
        they call the mesh axes that split a size (``dtp train``: the flags that size them,
        ``{"tp": "--tp"}``), and then they say which of those split it, not which layout.
        """
        for opts in self.options:
            opts.check_sizes(sizes, mesh, self, what=what, names=names)
        self._check_rules(sizes, mesh, what, names)

    def check_batch(self, what: str, key: str, shape: Sequence[int], mesh: DeviceMesh, *,
                    microbatches: int = 1) -> None:
        """``ValueError`` unless the global batch entry ``batch[key]`` of ``shape`` fits every
        option (:meth:`Option.check_batch`: the sequence over 2·cp for zigzag, pipe-experts'
        tokens per rank in each of ``microbatches``); ``what`` starts the message.

        >>> from dtp.core.mesh.shape import MeshShape
        >>> dtp.layouts.context("ring").check_batch(  # doctest: +ELLIPSIS
        ...     "shard_batch", "tokens", (2, 6), MeshShape({"cp": 2}))
        Traceback (most recent call last):
        ValueError: shard_batch: batch['tokens'] of shape (2, 6): zigzag load balancing cuts the sequence into 2*cp chunks, ...
        """
        for opts in self.options:
            opts.check_batch(what, key, shape, self, mesh, microbatches=microbatches)

    def arrange_batch(self, batch: Mapping[str, Any], mesh: DeviceMesh) -> dict[str, Any]:
        """The global batch (plain tensors, every rank alike) in the order the layout
        computes it in (:meth:`Option.arrange_batch`: zigzag's cp order, packed
        documents' balanced order); what :func:`dtp.shard_batch` then splits contiguously.

        >>> with simulate(2):
        ...     mesh = make_mesh(cp=2)
        ...     dtp.layouts.context("ring").arrange_batch({"tokens": torch.arange(8).view(1, 8)}, mesh)["tokens"].tolist()
        [[0, 1, 6, 7, 2, 3, 4, 5]]
        """
        out = dict(batch)
        for opts in self.options:
            out = opts.arrange_batch(out, self, mesh)
        return out

    def check_arranged(self, what: str, batch: Mapping[str, Any], mesh: DeviceMesh) -> None:
        """``ValueError`` when an entry of a placed ``batch`` should have come through
        :meth:`arrange_batch` and did not: it is not a tensor :func:`dtp.shard_batch` placed
        there (:class:`PlacedBatch`; :meth:`Option.check_arranged`)."""
        placed = isinstance(batch, PlacedBatch)
        for key, v in batch.items():
            arranged = placed and batch.placed(key, v)
            for opts in self.options:
                opts.check_arranged(what, key, v, arranged, batch, self, mesh)

    def splits(self, logical: Sequence[str | None], mesh: DeviceMesh, *, activation: bool = True) -> list[int]:
        """How many ways each dim of a tensor with these logical axes is split on ``mesh``,
        as its spec resolves them (a mesh axis splits one dim at most: the first claim).

        >>> from dtp.core.mesh.shape import MeshShape
        >>> (dtp.layouts.data() + dtp.layouts.context("ring")).splits(("batch", "seq"), MeshShape({"dp": 2, "cp": 4}))
        [2, 4]
        """
        names, sizes = axis_names(mesh), []
        for axes in self._dims(self.activations if activation else self.params, logical, mesh, ""):
            sizes.append(math.prod(mesh.size(names.index(a)) for a in axes or ()))
        return sizes

    def _check_rules(self, sizes: Mapping[str, int], mesh: DeviceMesh, what: str,
                     names: Mapping[str, str] | None) -> None:
        # The rules are the layout's own (every preset adds to them), so this check is too.
        for logical, size in sizes.items():
            for activation in (False, True):
                n = self.degree(logical, mesh, activation=activation)
                if size % n:
                    axes = self.mesh_axes(logical, mesh, activation=activation)
                    split = " × ".join(f"{a}={mesh.size(axis_names(mesh).index(a))}" for a in axes)
                    split += f" = {n}" if len(axes) > 1 else ""  # "tp=3", not "tp=3 = 3"
                    why, smaller = (f"layout {self.name or 'custom'}", "/".join(axes)) if names is None \
                        else split_in_words(names, axes, logical)
                    raise ValueError(f"{what}: {logical}={size} is not divisible by {split} ({why}); "
                                     f"{choose(names, logical, n)}, or a smaller {smaller}")


class PlacedBatch(dict):
    """What :func:`dtp.shard_batch` returns: the batch's entries placed where the layout
    computes them, in the order it computes them in (:meth:`Layout.arrange_batch`). A
    plain ``dict`` otherwise, that knows which tensors it was given by the layout: an
    entry replaced since (``batch["tokens"] = dtp.shard(...)``), or a copy of the batch
    (``dict(batch)``, ``{**batch}``), is placed by hand, which zigzag context parallel
    refuses (:meth:`Layout.check_arranged`: the order is in the values, no placement
    shows it).

    >>> batch = PlacedBatch.of({"tokens": torch.zeros(2)})
    >>> batch.placed("tokens", batch["tokens"]), batch.placed("tokens", torch.zeros(2))
    (True, False)
    """

    _arranged: dict[str, int]

    @classmethod
    def of(cls, placed: Mapping[str, Any]) -> "PlacedBatch":
        """The batch of these entries, each as the layout placed it."""
        batch = cls(placed)
        batch._arranged = {k: id(v) for k, v in placed.items()}  # the batch holds them: the ids stay theirs
        return batch

    def placed(self, key: str, value: Any) -> bool:
        """Whether ``value`` is the tensor the layout placed as ``key``."""
        return getattr(self, "_arranged", {}).get(key) == id(value) and dict.get(self, key) is value


# No option family may take the name of a Layout attribute (it would hide it).
Option.reserve(name for name in dir(Layout) if not name.startswith("_"))

_active = threading.local()


def current() -> tuple[Layout, DeviceMesh] | None:
    """The ``(layout, mesh)`` made active by :func:`use_layout`, or ``None``.

    >>> mesh = make_mesh(dp=1)
    >>> with use_layout(dtp.layouts.data(), mesh) as layout:
    ...     current() == (layout, mesh)
    True
    >>> current() is None
    True
    """
    stack = getattr(_active, "stack", [])
    return stack[-1] if stack else None


@contextlib.contextmanager
def use_layout(layout: Layout, mesh: DeviceMesh) -> Iterator[Layout]:
    """Make ``layout`` on ``mesh`` active (like Flax's ``logical_axis_rules``).

    >>> with simulate(2):
    ...     mesh = make_mesh(dp=2)
    ...     with use_layout(dtp.layouts.data(), mesh):
    ...         h = constrain(dtp.shard(torch.zeros(4, 8, 16), mesh, P()), ("batch", "seq", "embed"))
    ...     dtp.spec_of(h)                                      # the batch split over dp, as data() says
    P('dp')
    """
    if not hasattr(_active, "stack"):
        _active.stack = []
    _active.stack.append((layout, mesh))
    try:
        yield layout
    finally:
        _active.stack.pop()


_dtensor_type: list[type] = []  # DTensor, imported at first use: this module loads without torch (the CLI)


def _is_dtensor(x: object) -> bool:
    if not _dtensor_type:
        from torch.distributed.tensor import DTensor

        _dtensor_type.append(DTensor)
    return isinstance(x, _dtensor_type[0])


def constrain(x: torch.Tensor, logical: Sequence[str | None], *, name: str = "activation") -> torch.Tensor:
    """``with_sharding_constraint``: reshard ``x`` to where the active layout puts it.

    Without an active layout (or for a plain tensor) it returns ``x`` unchanged, so the
    same model code runs on one device.

    >>> h = constrain(h, ("batch", "res_seq", "embed"))       # doctest: +SKIP
    """
    active = current()
    if active is None or not _is_dtensor(x):
        return x  # before the import below: one device calls this per block, every step
    from ..core.redistribute import reshard  # torch: the layouts are read before torch loads (the CLI's checks)

    layout, mesh = active
    if len(logical) != x.dim():
        raise ValueError(f"{name}: {len(logical)} logical axes {tuple(logical)} for a tensor of shape {tuple(x.shape)}")
    spec = layout.activation_spec(logical, mesh, name=name)
    for opts in layout.options:  # an option that moves activations its own way (async TP's rings)
        moved = opts.constrain(x, spec, name)
        if moved is not None:
            return moved
    return reshard(x, spec, name=name, tag=name)
