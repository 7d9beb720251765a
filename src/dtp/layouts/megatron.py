"""Data parallel and Megatron tensor (+ sequence) parallel presets."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

from .core import Layout
from .option import Option

__all__ = ["MegatronOptions", "data", "megatron"]


def data(axis: str = "dp") -> Layout:
    """Data parallel: the batch is split over ``axis``; parameters are replicated.

    >>> data().activations["batch"]
    ('dp',)
    """
    return Layout({}, {"batch": (axis,)}, name="data")


@dataclass(frozen=True, kw_only=True)
class MegatronOptions(Option):
    """What :func:`megatron` was asked for; the rules it adds to the layout follow from it.

    >>> MegatronOptions(sequence_parallel=True)
    MegatronOptions(sequence_parallel=True, axis='tp', async_tp=False)
    """

    family = "megatron"

    sequence_parallel: bool = False  # split the residual stream's sequence over axis too (Megatron-SP)
    axis: str = "tp"  # the mesh axis heads, kv heads, MLP width and vocab are split over
    # SP's all-gathers / reduce-scatters as rings of send/recv hops under the block's
    # matmuls (dtp.ops.collective_matmul); needs sequence_parallel.
    async_tp: bool = False

    def __post_init__(self) -> None:
        for name in ("sequence_parallel", "async_tp"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"layouts.megatron: {name} must be a bool, got {getattr(self, name)!r}")
        if self.async_tp and not self.sequence_parallel:
            raise ValueError("layouts.megatron: async_tp overlaps sequence parallel's all-gathers and "
                             "reduce-scatters with the matmuls; it needs sequence_parallel=True")

    def constrain(self, x: Any, spec: Any, name: str) -> Any:
        """Async TP: sequence parallel's all-gather / reduce-scatter of ``x`` as a ring of
        hops under the next matmul (:mod:`dtp.ops.collective_matmul`); ``None`` (the plain
        reshard) without ``async_tp``."""
        if not self.async_tp:
            return None
        # Here, not at the top: the ops build on the layouts (and the CLI checks layouts before torch loads).
        from ..ops.collective_matmul import materialized, ring_constrain
        from ..core.redistribute import reshard

        ring = ring_constrain(x, spec, tag=name)
        return ring if ring is not None else reshard(materialized(x), spec, name=name, tag=name)


def megatron(sequence_parallel: bool = MegatronOptions.sequence_parallel, **options: str | bool) -> Layout:
    """Megatron tensor parallel over ``axis`` (optionally with sequence parallel).

    Column-parallel QKV / gate / up (output features on ``tp``), row-parallel output /
    down projections (input features on ``tp``), heads on ``tp``, a vocab-parallel
    embedding and cross-entropy. With ``sequence_parallel`` the residual stream (norms,
    residual adds) is split on sequence over ``tp``; entering a block is then an
    all-gather and leaving it a reduce-scatter, exactly Megatron-SP's collectives.
    Options (defaults in :class:`MegatronOptions`): ``sequence_parallel``, ``axis``,
    ``async_tp`` (the collective matmul of :mod:`dtp.ops.collective_matmul`: the block
    entry's all-gather and exit's reduce-scatter become rings of hops that move while the
    column / row-parallel matmuls run; the same values, bytes and rules; one-way at tp 2,
    bidirectional (tp // 2 steps, not tp - 1) from tp 3 up: :mod:`dtp.ops.tp_rings`).

    >>> megatron(sequence_parallel=True).activations["res_seq"]
    ('tp',)
    >>> megatron(sequence_parallel=True, async_tp=True).name
    'megatron(sequence_parallel=True, async_tp=True)'
    """
    opts = MegatronOptions(sequence_parallel=sequence_parallel, **options)  # type: ignore[arg-type]
    shard = {"heads": (opts.axis,), "kv_heads": (opts.axis,), "mlp": (opts.axis,), "vocab": (opts.axis,)}
    acts = dict(shard)
    if opts.sequence_parallel:
        acts["res_seq"] = (opts.axis,)
    name = f"megatron(sequence_parallel={opts.sequence_parallel}{', async_tp=True' if opts.async_tp else ''})"
    return Layout(shard, acts, megatron=opts, name=name)
