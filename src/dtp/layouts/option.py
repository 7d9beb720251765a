"""A layout option: one strategy's typed settings, which check themselves and their batch.

A :class:`~dtp.layouts.Layout` holds its options as a collection it iterates
(``layout.options``); each is a frozen dataclass subclassing :class:`Option` and naming
its ``family`` (the attribute the layout answers it under: ``layout.zero``,
``layout.context``, ``None`` when absent). Subclassing registers the family, so a new
strategy is a new module — its option, its ops, its state — and no edit here or in
:mod:`.core`. What a layout asks each option, every rank alike and before any collective:

=================================  ============================================================
``check_mesh(mesh, what)``         its mesh axes are on a mesh of more than one device
                                   (``requires_axes``: otherwise the feature would silently be off)
``check_sizes(sizes, mesh,         the model's logical axis sizes fit it (heads over the Ulysses
layout, what=, names=)``           degree, experts over ep, ...)
``check_batch(what, key, shape,    one (batch, seq, ...) entry of a step's global batch fits it
layout, mesh, microbatches=)``     (the sequence over 2·cp for zigzag, pipe-experts' tokens)
``arrange_batch(batch, layout,     the global batch in the order it computes in (zigzag's
mesh)``                            chunks, packed documents' balanced order); default: as it is
``check_arranged(what, key, v,     a placed entry came through ``arrange_batch`` (``arranged``:
arranged, batch, layout, mesh)``   ``dtp.shard_batch`` placed it)
``constrain(x, spec, name)``       an activation resharded its own way (async TP's rings), or
                                   ``None`` for the layout's plain ``reshard``
=================================  ============================================================

Messages name the option's fields (``window=2``, ``algo='ring'``); where a caller passes
``names`` (``dtp train``: field and mesh axis → flag, and ``"model"``: how to choose
another model) they say them in its words instead (:func:`said`, :func:`setting`,
:func:`choose`), so no caller rewrites a message. Torch-free at import, as
the layouts are (``dtp train`` checks a run before torch loads).

>>> from dtp.layouts.zero import ZeroOptions
>>> ZeroOptions.family, Option.family_of("zero") is ZeroOptions
('zero', True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from ..core.mesh.shape import axis_names
from ..core._rules import said, setting  # the caller's words for a field: also the model config's

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .core import Layout

__all__ = ["Option", "said", "setting", "choose"]


def choose(names: Mapping[str, str] | None, size: str, n: int) -> str:
    """What to choose when a model's ``size`` does not divide: a multiple of ``n`` (the
    caller's ``"model"`` entry says how to get another model).

    >>> choose(None, "heads", 8), choose({"model": "(--model)"}, "heads", 8)
    ('choose heads a multiple of 8', 'choose a model with heads a multiple of 8 (--model)')
    """
    model = (names or {}).get("model")
    return f"choose {size} a multiple of {n}" if model is None else f"choose a model with {size} a multiple of {n} {model}"


class Option:
    """Base of every layout option (module docstring). Subclasses set ``family``."""

    family: ClassVar[str] = ""  # the layout's attribute for it: layout.<family>
    requires_axes: ClassVar[bool] = False  # its mesh axes must be on any mesh of more than one device
    _registry: ClassVar[dict[str, type["Option"]]] = {}
    _reserved: ClassVar[set[str]] = {"params", "activations", "options", "name", "option"}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        family = cls.__dict__.get("family", "")
        if not family:
            return
        if not family.isidentifier() or family in Option._reserved:
            raise TypeError(f"layout option {cls.__name__}: family must be an identifier that is no Layout "
                            f"attribute, got {family!r}")
        known = Option._registry.get(family)
        # The same class defined again (a notebook cell re-run, a module reloaded) replaces itself.
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"layout option {cls.__name__}: family {family!r} is {known.__module__}."
                            f"{known.__qualname__}'s; choose another name")
        Option._registry[family] = cls

    @classmethod
    def reserve(cls, names: Any) -> None:
        """Names no family may take (``Layout``'s attributes: :mod:`.core` reserves them)."""
        Option._reserved.update(names)
    @classmethod
    def family_of(cls, family: str) -> type["Option"] | None:
        """The option class registered under ``family``, or ``None``."""
        return cls._registry.get(family)

    @classmethod
    def families(cls) -> tuple[str, ...]:
        """Every registered family, sorted."""
        return tuple(sorted(cls._registry))

    # ---- what a layout asks
    def mesh_axes(self) -> tuple[str, ...]:
        """The mesh axes this option works over (``axis``, or ``axes`` where it has several)."""
        axes = getattr(self, "axes", None)
        if axes is None:
            axis = getattr(self, "axis", None)
            axes = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        return tuple(axes)

    def check_mesh(self, mesh: DeviceMesh, what: str) -> None:
        """``ValueError`` when ``requires_axes`` and an axis of :meth:`mesh_axes` is not on
        ``mesh`` (of more than one device: one device runs everything plain)."""
        if not self.requires_axes or mesh.size() == 1:
            return
        names = axis_names(mesh)
        missing = [a for a in self.mesh_axes() if a not in names]
        if missing:
            axis = getattr(self, "axis", missing[0])
            raise ValueError(
                f"{what}: layouts.{self.family}(axis={axis!r}) names a mesh axis this mesh lacks "
                f"(its axes: {', '.join(names)}), so {self.family} would silently be off; build the mesh "
                f"with {missing[0]}=…, pass axis= one of its axes, or drop layouts.{self.family}"
            )

    def check_sizes(self, sizes: Mapping[str, int], mesh: DeviceMesh, layout: Layout, *, what: str,
                    names: Mapping[str, str] | None) -> None:
        """``ValueError`` unless the model's logical axis ``sizes`` fit this option."""

    def check_batch(self, what: str, key: str, shape: Sequence[int], layout: Layout, mesh: DeviceMesh, *,
                    microbatches: int = 1) -> None:
        """``ValueError`` unless the global batch entry ``batch[key]`` of ``shape`` fits."""

    def arrange_batch(self, batch: dict[str, Any], layout: Layout, mesh: DeviceMesh) -> dict[str, Any]:
        """The global batch (plain tensors) in the order this option computes it in."""
        return batch

    def check_arranged(self, what: str, key: str, value: Any, arranged: bool, batch: Mapping[str, Any],
                       layout: Layout, mesh: DeviceMesh) -> None:
        """``ValueError`` when entry ``batch[key]`` (``value``), which :meth:`arrange_batch`
        would have reordered, did not come through it (``arranged``: ``dtp.shard_batch``
        placed it)."""

    def constrain(self, x: Any, spec: Any, name: str) -> Any:
        """``x`` resharded to ``spec`` this option's way, or ``None``: the plain ``reshard``."""
        return None

