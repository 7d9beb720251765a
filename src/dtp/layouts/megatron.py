"""Data parallel and Megatron tensor (+ sequence) parallel presets."""

from __future__ import annotations

from dataclasses import dataclass

from .core import Layout

__all__ = ["MegatronOptions", "data", "megatron"]


def data(axis: str = "dp") -> Layout:
    """Data parallel: the batch is split over ``axis``; parameters are replicated.

    >>> data().activations["batch"]
    ('dp',)
    """
    return Layout({}, {"batch": (axis,)}, name="data")


@dataclass(frozen=True, kw_only=True)
class MegatronOptions:
    """What :func:`megatron` was asked for; the rules it adds to the layout follow from it.

    >>> MegatronOptions(sequence_parallel=True)
    MegatronOptions(sequence_parallel=True, axis='tp')
    """

    sequence_parallel: bool = False  # split the residual stream's sequence over axis too (Megatron-SP)
    axis: str = "tp"  # the mesh axis heads, kv heads, MLP width and vocab are split over

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"layouts.megatron: sequence_parallel must be a bool, got {self.sequence_parallel!r}")


def megatron(sequence_parallel: bool = MegatronOptions.sequence_parallel, **options: str) -> Layout:
    """Megatron tensor parallel over ``axis`` (optionally with sequence parallel).

    Column-parallel QKV / gate / up (output features on ``tp``), row-parallel output /
    down projections (input features on ``tp``), heads on ``tp``, a vocab-parallel
    embedding and cross-entropy. With ``sequence_parallel`` the residual stream (norms,
    residual adds) is split on sequence over ``tp``; entering a block is then an
    all-gather and leaving it a reduce-scatter, exactly Megatron-SP's collectives.
    Options (defaults in :class:`MegatronOptions`): ``sequence_parallel``, ``axis``.

    >>> megatron(sequence_parallel=True).activations["res_seq"]
    ('tp',)
    """
    opts = MegatronOptions(sequence_parallel=sequence_parallel, **options)
    shard = {"heads": (opts.axis,), "kv_heads": (opts.axis,), "mlp": (opts.axis,), "vocab": (opts.axis,)}
    acts = dict(shard)
    if opts.sequence_parallel:
        acts["res_seq"] = (opts.axis,)
    return Layout(shard, acts, megatron=opts, name=f"megatron(sequence_parallel={opts.sequence_parallel})")
