"""A system as data — chip, node and network — for the step-time model (:mod:`.time`).

Every figure is per device: a chip's dense peak FLOP/s per dtype, its memory and that
memory's bandwidth, how many devices share a node, the link between two devices of one node
(NVLink, HCCS, Infinity Fabric) and the one between nodes (InfiniBand / RoCE, per device:
a node's NICs divided by its devices), and the host link (PCIe). A link is α–β: ``latency``
seconds per message plus bytes / ``bandwidth``.

Torch-free: ``dtp plan`` reads hardware before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Link", "Chip", "Hardware"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """One device's link: ``bandwidth`` bytes/s each way, ``latency`` seconds per message.

    >>> Link(bandwidth=25e9, latency=5e-6).seconds(25e6)
    0.001005
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"Link: bandwidth must be > 0 and latency >= 0, got {self.bandwidth}, {self.latency}")

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """α·messages + β·bytes."""
        return messages * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator: dense peak FLOP/s by dtype name (``"bfloat16"``, ``"float32"``,
    ``"float64"``), memory bytes and bandwidth (bytes/s), and ``matmul_efficiency``: the
    fraction of peak a large GEMM reaches (a published cuBLAS / rocBLAS / CANN figure or
    this machine's calibration; never fitted to the runs it predicts)."""

    name: str
    flops: dict[str, float]
    memory: float
    memory_bandwidth: float
    matmul_efficiency: float

    def __post_init__(self) -> None:
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"Chip {self.name}: matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """A system: its chip, ``devices_per_node`` and the three links (per device).

    Mesh axes are laid out outer to inner (``dtp.make_mesh``'s order): an axis whose ranks
    all sit in one node (its size times the sizes inside it at most ``devices_per_node``)
    uses ``intra``; any other ``inter``."""

    name: str
    chip: Chip
    devices_per_node: int
    intra: Link
    inter: Link
    host: Link
    source: str = field(default="")
