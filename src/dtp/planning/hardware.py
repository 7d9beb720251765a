"""A system as data — chip, node and network — for the step-time model (:mod:`.time`).

Every figure is per device: a chip's dense peak FLOP/s per dtype, its memory and that
memory's bandwidth, how many devices share a node, the link between two devices of one node
(NVLink, HCCS, Infinity Fabric) and the one between nodes (InfiniBand / RoCE, per device:
a node's NICs divided by its devices), and the host link (PCIe). A link is α–β: ``latency``
seconds per message plus bytes / (``bandwidth`` · ``efficiency``); where measured, a
collective's own fixed cost by kind and group size (``collective_latency``) stands in for
its ring's steps of α. A chip may also carry what a measurement found beside its GEMM
figure: causal attention's fraction of peak (``attention_curve``) and each op's fixed
dispatch cost (``op_overhead``); the presets leave them at the GEMM figure and 0.

:data:`PRESETS` are six 8-device nodes, each figure with its source beside it; a system of
one's own is a TOML file (:func:`.hardware_toml.to_toml`, :func:`from_toml`), and ``dtp plan --calibrate``
writes one for this machine (:mod:`.calibrate`). :func:`hardware` reads either.

Torch-free: ``dtp plan`` reads hardware before torch is imported.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Link", "Chip", "Hardware", "PRESETS", "DTYPES", "COLLECTIVES", "hardware", "preset_of_device",
           "from_toml"]

# The dtype names a chip's peak may be given for: torch's names, and tfloat32 for float32
# matmuls run on tensor cores (torch.backends.cuda.matmul.allow_tf32; off by default).
DTYPES = ("float64", "float32", "tfloat32", "bfloat16", "float16", "float8")
# The collectives a link's measured fixed costs may name (dtp.comm's kinds; an uneven
# all_to_all_v is costed as an all_to_all).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True, kw_only=True)
class Link:
    """One device's link: ``bandwidth`` bytes/s each way (the line rate), ``latency``
    seconds per message, and ``efficiency``: the fraction of the line rate a collective
    library realises on it (nccl-tests' bus bandwidth over the line rate, or this machine's
    measurement; 1.0 when the bandwidth is itself measured).

    ``collective_latency``, where measured, holds ``(kind, ranks, seconds)``: the time a
    small collective of that kind (:data:`COLLECTIVES`) takes among that many ranks with
    every group running one at once — its fixed cost, which on a host whose ranks share
    cores is far more than its ring's steps of one message's α. :meth:`fixed` reads it.

    >>> Link(bandwidth=25e9, latency=5e-6).seconds(25e6)
    0.001005
    >>> Link(bandwidth=50e9, latency=0.0, efficiency=0.5).seconds(25e6)
    0.001
    """

    bandwidth: float
    latency: float
    efficiency: float = 1.0
    collective_latency: tuple[tuple[str, int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0 or not math.isfinite(self.bandwidth + self.latency):
            raise ValueError(f"Link: bandwidth must be > 0 and latency >= 0, got {self.bandwidth}, {self.latency}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Link: efficiency must be in (0, 1], got {self.efficiency}")
        seen = set()
        for row in self.collective_latency:
            ok = (len(row) == 3 and row[0] in COLLECTIVES and isinstance(row[1], int) and not isinstance(row[1], bool)
                  and row[1] >= 2 and isinstance(row[2], (int, float)) and math.isfinite(row[2]) and row[2] >= 0
                  and (row[0], row[1]) not in seen)
            if not ok:
                raise ValueError(f"Link: collective_latency rows must be (kind in {', '.join(COLLECTIVES)}, "
                                 f"ranks >= 2, seconds >= 0), each (kind, ranks) once; got {row!r}")
            seen.add((row[0], row[1]))

    def fixed(self, kind: str, ranks: int) -> float | None:
        """The measured fixed cost of a ``kind`` collective among ``ranks``: the row for that
        group size, else the nearest measured size's scaled by the ring's steps (which grow
        as ``n − 1`` for every kind); ``None`` where the kind was not measured.

        >>> link = Link(bandwidth=1e9, latency=1e-5, collective_latency=(("all_reduce", 2, 1e-3),
        ...                                                             ("all_reduce", 4, 6e-3)))
        >>> link.fixed("all_reduce", 4), link.fixed("all_reduce", 8), link.fixed("all_gather", 4)
        (0.006, 0.014, None)
        """
        rows = [(n, t) for k, n, t in self.collective_latency if k == kind]
        if not rows:
            return None
        n, t = min(rows, key=lambda r: (abs(math.log(r[0] / ranks)), -r[0]))
        return t if n == ranks else t * (ranks - 1) / (n - 1)

    @property
    def realised(self) -> float:
        """Bytes/s a transfer gets: ``bandwidth · efficiency``."""
        return self.bandwidth * self.efficiency

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        """α·messages + bytes / (β·efficiency)."""
        return messages * self.latency + nbytes / self.realised


@dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator: dense peak FLOP/s by dtype name (:data:`DTYPES`), memory bytes and
    bandwidth (bytes/s), and ``matmul_efficiency``: the fraction of peak a large GEMM
    reaches (a published GEMM benchmark or this machine's calibration; never fitted to the
    runs it predicts).

    ``matmul_curve``, where known, says how that fraction falls for smaller GEMMs:
    ``(m·n·k, fraction of peak)`` points, increasing in size; :meth:`matmul_fraction`
    interpolates them in log size and holds the end values beyond them. Empty: every GEMM
    gets ``matmul_efficiency``.

    ``attention_curve``, where measured, is causal attention's (SDPA forward and backward)
    fraction of peak, ``(seq · head_dim, fraction)`` points read the same way
    (:meth:`attention_fraction`); empty: attention runs at ``matmul_efficiency`` (the
    GEMMs of a FlashAttention-style kernel). ``op_overhead``: the seconds each unfused op
    costs beyond its bytes and FLOPs (dispatch, autograd bookkeeping), measured on tiny
    tensors; 0 where not measured (a GPU's launches run ahead of its kernels).

    >>> c = Chip(name="x", flops={"float32": 1e12}, memory=1e9, memory_bandwidth=1e10,
    ...          matmul_efficiency=0.9, matmul_curve=((1e6, 0.3), (1e9, 0.9)))
    >>> round(c.matmul_fraction(1000, 1000, 1000), 3), c.matmul_fraction(10, 10, 10)
    (0.9, 0.3)
    >>> round(c.matmul_fraction(10**3, 10**3, 10**1.5), 3)   # half way in log size
    0.6
    >>> c.attention_fraction(512, 64)                         # no attention curve: the GEMM figure
    0.9
    """

    name: str
    flops: dict[str, float]
    memory: float
    memory_bandwidth: float
    matmul_efficiency: float
    matmul_curve: tuple[tuple[float, float], ...] = ()
    attention_curve: tuple[tuple[float, float], ...] = ()
    op_overhead: float = 0.0

    def __post_init__(self) -> None:
        where = f"Chip {self.name}"
        if not self.flops:
            raise ValueError(f"{where}: flops must name at least one dtype of {', '.join(DTYPES)}")
        for dtype, value in self.flops.items():
            if dtype not in DTYPES:
                raise ValueError(f"{where}: flops has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
            _positive(f"{where}: flops[{dtype!r}]", value)
        _positive(f"{where}: memory", self.memory)
        _positive(f"{where}: memory_bandwidth", self.memory_bandwidth)
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"{where}: matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")
        for key in ("matmul_curve", "attention_curve"):
            curve = getattr(self, key)
            sizes = [s for s, _ in curve]
            if any(not (s > 0 and 0 < f <= 1) for s, f in curve) or sizes != sorted(set(sizes)):
                raise ValueError(f"{where}: {key} must be (size > 0, fraction in (0, 1]) points of "
                                 f"increasing size, got {curve}")
        if isinstance(self.op_overhead, bool) or not isinstance(self.op_overhead, (int, float)) \
                or not (math.isfinite(self.op_overhead) and self.op_overhead >= 0):
            raise ValueError(f"{where}: op_overhead must be a finite number >= 0, got {self.op_overhead!r}")

    def matmul_fraction(self, m: float, n: float, k: float) -> float:
        """The fraction of peak an ``m × k`` by ``k × n`` GEMM reaches (see the class)."""
        return _interpolate(self.matmul_curve, m * n * k, self.matmul_efficiency)

    def attention_fraction(self, seq: float, head_dim: float) -> float:
        """The fraction of peak causal attention over ``seq`` keys of ``head_dim`` reaches
        (see the class)."""
        return _interpolate(self.attention_curve, seq * head_dim, self.matmul_efficiency)


def _interpolate(curve: tuple[tuple[float, float], ...], size: float, default: float) -> float:
    """``curve``'s fraction at ``size``, linear in log size between its points and held
    beyond its ends; ``default`` for an empty curve."""
    if not curve:
        return default
    x = math.log(max(size, 1.0))
    logs = [math.log(s) for s, _ in curve]
    if x <= logs[0]:
        return curve[0][1]
    for (x0, (_, f0)), (x1, (_, f1)) in zip(zip(logs, curve), zip(logs[1:], curve[1:])):
        if x <= x1:
            return f0 + (f1 - f0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """A system: its chip, ``devices_per_node`` and the three links (per device).

    Mesh axes are laid out outer to inner (``dtp.make_mesh``'s order): an axis whose ranks
    all sit in one node (its size times the sizes inside it at most ``devices_per_node``)
    uses ``intra``; any other ``inter``. ``source`` says where the figures come from."""

    name: str
    chip: Chip
    devices_per_node: int
    intra: Link
    inter: Link
    host: Link
    source: str = field(default="")

    def __post_init__(self) -> None:
        if isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int) \
                or self.devices_per_node < 1:
            raise ValueError(f"Hardware {self.name}: devices_per_node must be an integer >= 1, "
                             f"got {self.devices_per_node!r}")


def _positive(what: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")


def _node(nics: int, nic_bits_per_s: float, devices: int) -> float:
    """A node's NIC line rate per device, bytes/s: ``nics × rate / devices``."""
    return nics * nic_bits_per_s / 8 / devices


GB = 1e9  # datasheets print decimal GB and GB/s
T = 1e12


# ---------------------------------------------------------------------------------------------
# Presets. Each figure says where it is from: [datasheet] a vendor's peak, as printed (and
# where checked, the page it was checked on); [measured] a published benchmark's figure;
# [UNSOURCED] a figure no source was found for, kept so the type is whole and said as such.
#
# Sources cited below, by key:
#   NV-A100   NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), its
#             table as reproduced at https://glennklockwood.com/garden/processors/A100
#   NV-H100   NVIDIA H100 datasheet, table at https://glennklockwood.com/garden/processors/h100
#             and https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html ("* Shown with
#             sparsity. Specifications 1/2 lower without sparsity")
#   NV-H200   NVIDIA H200: same GH100 compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s
#             (https://aiwiki.ai/wiki/nvidia_h200, https://lzwjava.github.io/nvidia-h200-gpu-specs-en)
#   NV-B200   HGX B200 at 1000 W, https://glennklockwood.com/garden/processors/B200; torchao's
#             matmul benchmark prints the same peak ("peak tops: bf16 2.25e+15",
#             https://github.com/pytorch/ao/pull/2427); 180 GB usable per GPU in DGX/HGX
#             (stas00/ml-engineering compute/accelerator/README.md, memory table)
#   AMD-MI300X AMD Instinct MI300X datasheet figures (1307.4 TFLOPS dense BF16, 163.4 FP32 /
#             FP64 matrix, 192 GB HBM3, 5.3 TB/s), https://gpu.blog/gpus/instinct-mi300x-mi300x
#             (896 GB/s aggregate Infinity Fabric, PCIe Gen5 x16) and
#             https://www.codesota.com/hardware/mi300x
#   MAMF      "Maximum Achievable Matmul FLOPS" table, stas00/ml-engineering
#             compute/accelerator/README.md: torch.matmul BF16, best shape of a brute-force
#             search (mamf-finder.py), mean of 100 iterations. [measured]
#   NCCL-212  https://github.com/NVIDIA/nccl-tests/issues/212, sjeaugey (NCCL): "450GB/s is
#             the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink
#             bandwidth of 370GB/s" (H100). [measured]
#   NCCL-412  https://github.com/NVIDIA/nccl/issues/412, sjeaugey: an 8 × A800 node should
#             show "~160GB/s intra-node and 24GB/s inter-node" busbw at 8 GB (A800: NVLink3 at
#             200 GB/s each way; one HDR 200 Gb/s NIC). [measured]
#   NCCL-1048 https://github.com/NVIDIA/nccl/issues/1048: two A100 nodes, all-reduce over one
#             HDR NIC "reach[es] the theoretical value(24GB/s)"; over 4 dual-port HDR NICs
#             86 GB/s of a theoretical 96 (NCCL runs a ring per NIC). [measured]
#   NCCL-290  https://github.com/NVIDIA/nccl-tests/issues/290, AddyLaddy (NCCL): "For NDR @
#             400Gbps you should see 46-48GB/s per NIC"; nccl-tests#267: "up to 48-49GB/s per
#             NIC". [measured]
#   RCCL-1210 https://github.com/ROCm/rccl/issues/1210, gilbertlee-amd (AMD): "After protocol
#             and error correction overheads, the max theoretical per-direction bandwidth for
#             gfx94 devices is 48GB/s" per xGMI link, of 64 GB/s. [measured-derived]
#   MSCCLPP  https://github.com/microsoft/mscclpp/pull/507: a 1 KiB all-reduce over an
#             NVLink-SHARP node takes 5.45 µs (nccl-tests' output) — the order of one NVLink
#             message's α; used as such, not as a per-generation figure.
#   DGX-A100 Selene's DGX A100 nodes as PTD-P describes them (Narayanan et al. 2021,
#             arXiv:2104.04473 §5, checked: "Each node has eight NVIDIA Mellanox 200Gbps HDR
#             Infiniband HCAs for application communication"; "The peak device throughput of
#             an A100 GPU with 16-bit precision is 312 teraFLOP/s"); the same in NVIDIA's DGX
#             SuperPOD reference architecture RA-09950-001. [datasheet]
#   NCCL-150 https://github.com/NVIDIA/nccl-tests/issues/150: two A100 80GB nodes on HDR
#             InfiniBand, one GPU each, an 8 B all_reduce_perf takes 19-20 µs: two ring steps,
#             ~10 µs a step. [measured; the issue reports a failure at larger sizes]
#   DGX-H100 DGX H100 / H200: 8 single-port ConnectX-7 NDR 400 Gb/s
#             (https://fibermall.com/ru/blog/how-to-build-cluster-with-128-dgx-h100.htm). [datasheet]
#
# The inter-node latency: 10 µs is an order of magnitude for a NCCL/RCCL message over one
# switch hop; measured for A100s on HDR (NCCL-150), [UNSOURCED] for the other presets' NICs.
# The time model's α terms are that uncertain.

_NV_INTRA_LATENCY = 5e-6   # MSCCLPP (order of magnitude)
_INTER_LATENCY = 10e-6     # NCCL-150 for A100 + HDR; [UNSOURCED] elsewhere, see above


def _a100() -> Hardware:
    chip = Chip(
        name="NVIDIA A100 SXM4 80GB",
        flops={"bfloat16": 312 * T, "float16": 312 * T,    # NV-A100 dense tensor core (624 is with sparsity)
               "tfloat32": 156 * T,                         # NV-A100 dense TF32
               "float32": 19.5 * T,                         # NV-A100 FP32 (no tensor core)
               "float64": 19.5 * T},                        # NV-A100 FP64 tensor core (9.7 without)
        memory=80 * GB,                                     # NV-A100: 80 GB HBM2e
        memory_bandwidth=2039 * GB,                         # NV-A100: 2,039 GB/s
        matmul_efficiency=0.869,                            # MAMF: 271.2 of 312 TFLOPS (torch 2.6, cu126)
    )
    return Hardware(
        name="a100-80gb", chip=chip, devices_per_node=8,    # DGX A100: 8 GPUs
        # NVLink3: 600 GB/s per GPU both ways together, 300 GB/s each way [datasheet, NV-A100];
        # NCCL realises ~80% (NCCL-412: A800's NVLink3 160 of 200 GB/s; NCCL-212: ~20% overhead)
        intra=Link(bandwidth=300 * GB, latency=_NV_INTRA_LATENCY, efficiency=0.80),
        # 8 × HDR 200 Gb/s per node (DGX-A100) = 25 GB/s per GPU; NCCL-412 and NCCL-1048: 24 GB/s
        # busbw per NIC; α: NCCL-150
        inter=Link(bandwidth=_node(8, 200e9, 8), latency=_INTER_LATENCY, efficiency=0.96),
        # PCIe Gen4 x16: 32 GB/s each way [datasheet, NV-A100 "32+32 GB/s"]; no realised figure found
        host=Link(bandwidth=32 * GB, latency=0.0),
        source="DGX A100 (Selene, as PTD-P): NVIDIA A100 datasheet; MAMF matmul; NCCL busbw (nccl#412, nccl-tests#212)",
    )


def _hopper(name: str, chip_name: str, memory: float, bandwidth: float, note: str) -> Hardware:
    chip = Chip(
        name=chip_name,
        flops={"bfloat16": 989.4 * T, "float16": 989.4 * T,  # NV-H100 dense (1,979 is with sparsity)
               "tfloat32": 494.7 * T,                        # NV-H100 dense TF32
               "float32": 66.9 * T,                          # NV-H100 FP32 (datasheet: 67)
               "float64": 66.9 * T},                         # NV-H100 FP64 tensor core (34 without)
        memory=memory, memory_bandwidth=bandwidth,
        matmul_efficiency=0.803,                             # MAMF: 794.5 of 989 (H100 SXM; "H200 is the same")
    )
    return Hardware(
        name=name, chip=chip, devices_per_node=8,
        # NVLink4: 900 GB/s both ways, 450 each way [datasheet]; NCCL-212: 370 of 450 GB/s realised
        intra=Link(bandwidth=450 * GB, latency=_NV_INTRA_LATENCY, efficiency=370 / 450),
        # 8 × ConnectX-7 NDR 400 Gb/s per node (DGX-H100) = 50 GB/s per GPU; NCCL-290: 46-48 GB/s
        inter=Link(bandwidth=_node(8, 400e9, 8), latency=_INTER_LATENCY, efficiency=0.94),
        # PCIe Gen5 x16: 128 GB/s both ways, 64 each way [datasheet, NV-H100]; no realised figure found
        host=Link(bandwidth=64 * GB, latency=0.0),
        source=note,
    )


def _b200() -> Hardware:
    chip = Chip(
        name="NVIDIA B200 (HGX/DGX, 1000 W)",
        flops={"bfloat16": 2250 * T, "float16": 2250 * T,    # NV-B200 dense (4,500 with sparsity)
               "tfloat32": 1100 * T,                         # NV-B200 dense TF32
               "float32": 80 * T,                            # NV-B200 FP32
               "float64": 40 * T},                           # NV-B200 FP64
        memory=180 * GB,                                     # NV-B200: 180 GB usable (192 physical)
        memory_bandwidth=8000 * GB,                          # NV-B200: 8 TB/s
        matmul_efficiency=0.776,                             # MAMF: 1,745 of 2,250 (torch 2.7.1, cu128)
    )
    return Hardware(
        name="b200", chip=chip, devices_per_node=8,
        # NVLink5: 1.8 TB/s both ways, 900 GB/s each way [datasheet, NV-B200]. No NCCL busbw for
        # NVLink5 was found: Hopper's 370/450 (NCCL-212, NCCL's protocol overhead) is assumed [UNSOURCED]
        intra=Link(bandwidth=900 * GB, latency=_NV_INTRA_LATENCY, efficiency=370 / 450),
        # DGX B200: 8 × ConnectX-7 400 Gb/s (DGX B200 datasheet; not re-checked here); NCCL-290's NDR figure
        inter=Link(bandwidth=_node(8, 400e9, 8), latency=_INTER_LATENCY, efficiency=0.94),
        # The GPU has PCIe Gen6, but DGX B200's hosts (Xeon 8570) are Gen5: 64 GB/s each way
        # [datasheet, not re-checked here]
        host=Link(bandwidth=64 * GB, latency=0.0),
        source="DGX B200: HGX B200 figures (1000 W); MAMF matmul; NVLink5 efficiency assumed from Hopper's",
    )


def _mi300x() -> Hardware:
    chip = Chip(
        name="AMD Instinct MI300X",
        flops={"bfloat16": 1307.4 * T, "float16": 1307.4 * T,  # AMD-MI300X dense matrix (2,614.9 sparse)
               "float32": 163.4 * T,                           # AMD-MI300X FP32 matrix
               "float64": 163.4 * T},                          # AMD-MI300X FP64 matrix (81.7 vector)
        memory=192 * GB,                                       # AMD-MI300X: 192 GB HBM3
        memory_bandwidth=5300 * GB,                            # AMD-MI300X: 5.3 TB/s
        # MAMF: 668.4 of 1,300 with PYTORCH_TUNABLEOP_ENABLED=1 (ROCm 6.3); an older row of the
        # same table had 781.9 (ROCm 6.2): the figure moves with the software stack
        matmul_efficiency=0.514,
    )
    return Hardware(
        name="mi300x", chip=chip, devices_per_node=8,
        # Infinity Fabric: 7 xGMI links × 64 GB/s each way = 448 GB/s per GPU (896 GB/s both ways,
        # AMD-MI300X) — but a fully connected mesh: one peer gets one link's 64 GB/s. RCCL-1210:
        # 48 of 64 GB/s per link after protocol and error-correction overheads
        intra=Link(bandwidth=448 * GB, latency=_NV_INTRA_LATENCY, efficiency=48 / 64),
        # 8 × 400 Gb/s NICs per node, one per GPU, as MI300X platforms ship (e.g. Azure ND MI300X
        # v5) [UNSOURCED here]; NDR efficiency from NCCL-290 assumed for RCCL [UNSOURCED]
        inter=Link(bandwidth=_node(8, 400e9, 8), latency=_INTER_LATENCY, efficiency=0.94),
        host=Link(bandwidth=64 * GB, latency=0.0),             # PCIe Gen5 x16 (AMD-MI300X), 64 GB/s each way
        source="8 × MI300X node: AMD MI300X datasheet; MAMF matmul; RCCL xGMI efficiency (rccl#1210)",
    )


def _ascend_910b() -> Hardware:
    # Huawei publishes no datasheet for the 910B that was found; third-party figures conflict
    # (FP16: 256 TFLOPS https://jishuzhan.net/article/1872432607539499010 — the 910's figure;
    # ~320 https://boardor.com/blog/huawei-ascend-910b-outperforms-h20-910c-approaches-h100;
    # 376 for a 910B2 in a deployment study). Every figure of this preset is [UNSOURCED] in
    # that sense: a third-party page's, kept so the 910B can be planned at all.
    chip = Chip(
        name="Huawei Ascend 910B",
        flops={"bfloat16": 320 * T, "float16": 320 * T,  # boardor.com: "approximately 320 TFLOPS" FP16
               "float32": 128 * T},                       # jishuzhan.net: 128 TFLOPS FP32 (for the 910)
        memory=64 * GB,                                   # boardor.com: 64 GB HBM2e
        memory_bandwidth=1600 * GB,                       # [UNSOURCED] the widely quoted 1.6 TB/s
        matmul_efficiency=1.0,                            # [UNSOURCED] no published GEMM efficiency: peak assumed
    )
    return Hardware(
        name="ascend-910b", chip=chip, devices_per_node=8,  # Atlas 800T A2: 8 NPUs
        # HCCS full mesh: 7 × 56 GB/s = 392 GB/s both ways [UNSOURCED], 196 each way; no hccl_test
        # figure found, so the line rate (efficiency 1.0) is used: an optimistic link
        intra=Link(bandwidth=196 * GB, latency=_NV_INTRA_LATENCY),
        # 8 × 200 GE RoCE per node, one per NPU [UNSOURCED] = 25 GB/s; no realised figure found
        inter=Link(bandwidth=_node(8, 200e9, 8), latency=_INTER_LATENCY),
        host=Link(bandwidth=31.5 * GB, latency=0.0),        # PCIe 4.0 x16 (jishuzhan.net: 31.5 GB/s)
        source="Atlas 800T A2 (8 × Ascend 910B): third-party figures, no vendor datasheet found; see hardware.py",
    )


PRESETS: dict[str, Hardware] = {
    "a100-80gb": _a100(),
    "h100-sxm": _hopper("h100-sxm", "NVIDIA H100 SXM5 80GB", 80 * GB, 3350 * GB,  # NV-H100: 80 GB HBM3, 3.35 TB/s
                        "DGX H100: NVIDIA H100 datasheet; MAMF matmul; NCCL busbw (nccl-tests#212, #290)"),
    "h200": _hopper("h200", "NVIDIA H200 SXM 141GB", 141 * GB, 4800 * GB,         # NV-H200: 141 GB HBM3e, 4.8 TB/s
                    "DGX H200: H100's compute (NVIDIA), 141 GB at 4.8 TB/s; MAMF matmul (H100's); NCCL busbw"),
    "b200": _b200(),
    "ascend-910b": _ascend_910b(),
    "mi300x": _mi300x(),
}


# What a device calls itself (torch.cuda.get_device_name, torch.npu's) -> the preset of its
# node. Checked in order: "H100" before a bare "100"; an A100 of 40 GB is no preset.
_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("B200", "b200"), ("A100-SXM4-80GB", "a100-80gb"),
                 ("A100 80GB", "a100-80gb"), ("MI300X", "mi300x"), ("910B", "ascend-910b"))


def preset_of_device(device_name: str) -> str | None:
    """The preset for an accelerator by the name its runtime reports, or ``None``.

    >>> preset_of_device("NVIDIA H100 80GB HBM3"), preset_of_device("NVIDIA A100-SXM4-40GB")
    ('h100-sxm', None)
    """
    for part, preset in _DEVICE_NAMES:
        if part.lower() in device_name.lower():
            return preset
    return None


def hardware(name_or_path: str) -> Hardware:
    """A preset by name (case-insensitive, :data:`PRESETS`) or a TOML file's system (:func:`from_toml`).

    >>> hardware("H100-SXM").chip.flops["bfloat16"]
    989400000000000.0
    >>> hardware("tpu-v5")
    Traceback (most recent call last):
    ...
    ValueError: unknown hardware 'tpu-v5': neither a preset (a100-80gb, h100-sxm, h200, b200, ascend-910b, mi300x) nor a file
    """
    preset = PRESETS.get(name_or_path.lower())
    if preset is not None:
        return preset
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown hardware {name_or_path!r}: neither a preset ({', '.join(PRESETS)}) nor a file")
    try:
        return from_toml(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


_LINKS = ("intra", "inter", "host")
_LINK_FIELDS = ("bandwidth", "latency", "efficiency", "collective_latency")
_CHIP_FIELDS = ("name", "memory", "memory_bandwidth", "matmul_efficiency", "matmul_curve", "attention_curve",
                "op_overhead", "flops")
_TOP_FIELDS = ("name", "devices_per_node", "source", "chip", *_LINKS)


def _table(data: dict[str, Any], where: str, fields: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"hardware TOML: unknown field {where}{unknown[0]} (known: {', '.join(fields)})")
    missing = [f for f in required if f not in data]
    if missing:
        raise ValueError(f"hardware TOML: missing field {where}{missing[0]}")
    return data


def _number(data: dict[str, Any], key: str, where: str, *, low: float = 0.0, strict: bool = True,
            high: float = math.inf) -> float:
    v = data[key]
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) \
        and (v > low if strict else v >= low) and v <= high
    if not ok:
        bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
        raise ValueError(f"hardware TOML: {where}{key} must be a number {bound}, got {v!r}")
    return float(v)


def _string(data: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(data[key], str):
        raise ValueError(f"hardware TOML: {where}{key} must be a string, got {data[key]!r}")
    return data[key]


def _sub(data: dict[str, Any], key: str) -> dict[str, Any]:
    if not isinstance(data[key], dict):
        raise ValueError(f"hardware TOML: {key} must be a table ([{key}]), got {data[key]!r}")
    return data[key]


def _curve(chip: dict[str, Any], key: str) -> tuple[tuple[float, float], ...]:
    """``chip[key]``'s ``[size, fraction]`` points, each checked (none: empty)."""
    raw = chip.get(key, [])
    if not isinstance(raw, list) or any(not isinstance(p, list) or len(p) != 2 for p in raw):
        raise ValueError(f"hardware TOML: chip.{key} must be a list of [size, fraction] pairs, got {raw!r}")
    out = []
    for i, p in enumerate(raw):
        point = {"size": p[0], "fraction": p[1]}
        out.append((_number(point, "size", f"chip.{key}[{i}]."),
                    _number(point, "fraction", f"chip.{key}[{i}].", high=1.0)))
    return tuple(out)


def _collectives(link: dict[str, Any], key: str) -> tuple[tuple[str, int, float], ...]:
    """``link``'s ``collective_latency`` rows ``[kind, ranks, seconds]``, each checked."""
    raw = link.get("collective_latency", [])
    where = f"{key}.collective_latency"
    if not isinstance(raw, list) or any(not isinstance(r, list) or len(r) != 3 for r in raw):
        raise ValueError(f"hardware TOML: {where} must be a list of [kind, ranks, seconds], got {raw!r}")
    out = []
    for i, (kind, ranks, seconds) in enumerate(raw):
        if kind not in COLLECTIVES:
            raise ValueError(f"hardware TOML: {where}[{i}] kind must be one of {', '.join(COLLECTIVES)}, got {kind!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
            raise ValueError(f"hardware TOML: {where}[{i}] ranks must be an integer >= 2, got {ranks!r}")
        out.append((kind, ranks, _number({"seconds": seconds}, "seconds", f"{where}[{i}].", strict=False)))
    try:
        Link(bandwidth=1.0, latency=0.0, collective_latency=tuple(out))
    except ValueError:  # a (kind, ranks) twice
        raise ValueError(f"hardware TOML: {where} names a (kind, ranks) twice: {raw!r}") from None
    return tuple(out)


def from_toml(text: str) -> Hardware:
    """The system a TOML text describes (:func:`to_toml`'s layout). Every field is checked;
    an error names the field.

    >>> from dtp.planning.hardware_toml import to_toml
    >>> from_toml(to_toml(PRESETS["h200"]).replace("devices_per_node = 8", "devices_per_node = 0"))
    Traceback (most recent call last):
    ...
    ValueError: hardware TOML: devices_per_node must be an integer >= 1, got 0
    >>> from_toml(to_toml(PRESETS["h200"]).replace("[inter]", "[inter]\\nbandwith = 1.0"))
    Traceback (most recent call last):
    ...
    ValueError: hardware TOML: unknown field inter.bandwith (known: bandwidth, latency, efficiency, collective_latency)
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"hardware TOML: not TOML ({e})") from None
    _table(data, "", _TOP_FIELDS, ("name", "devices_per_node", "chip", *_LINKS))
    dpn = data["devices_per_node"]
    if isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1:
        raise ValueError(f"hardware TOML: devices_per_node must be an integer >= 1, got {dpn!r}")
    chip = _table(_sub(data, "chip"), "chip.", _CHIP_FIELDS,
                  ("name", "memory", "memory_bandwidth", "matmul_efficiency", "flops"))
    flops = _table(_sub(chip, "flops"), "chip.flops.", DTYPES, ())
    if not flops:
        raise ValueError(f"hardware TOML: chip.flops must name at least one dtype of {', '.join(DTYPES)}")
    curves = {key: _curve(chip, key) for key in ("matmul_curve", "attention_curve")}
    links = {}
    for key in _LINKS:
        link = _table(_sub(data, key), f"{key}.", _LINK_FIELDS, ("bandwidth", "latency"))
        links[key] = Link(bandwidth=_number(link, "bandwidth", f"{key}."),
                          latency=_number(link, "latency", f"{key}.", strict=False),
                          efficiency=_number(link, "efficiency", f"{key}.", high=1.0) if "efficiency" in link else 1.0,
                          collective_latency=_collectives(link, key))
    try:
        c = Chip(name=_string(chip, "name", "chip."),
                 flops={k: _number(flops, k, "chip.flops.") for k in flops},
                 memory=_number(chip, "memory", "chip."), memory_bandwidth=_number(chip, "memory_bandwidth", "chip."),
                 matmul_efficiency=_number(chip, "matmul_efficiency", "chip.", high=1.0),
                 op_overhead=_number(chip, "op_overhead", "chip.", strict=False) if "op_overhead" in chip else 0.0,
                 **curves)
    except ValueError as e:  # Chip's own checks (a curve out of order): they name the field
        if str(e).startswith("hardware TOML"):
            raise
        raise ValueError(f"hardware TOML: {e}") from None
    return Hardware(name=_string(data, "name", ""), chip=c, devices_per_node=dpn,
                    source=_string(data, "source", "") if "source" in data else "", **links)
