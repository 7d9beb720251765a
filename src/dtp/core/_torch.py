"""Every private torch API dtp relies on, in one place.

Each entry says what dtp uses it for and the public alternative, if there is one. A
torch upgrade that moves or removes one fails here (and in
``tests/test_torch_internals.py``), not somewhere deep in an op. Nothing else in dtp
imports from ``torch._*``, ``torch.distributed._*``, ``torch.testing._internal`` or
reads a private attribute of a torch object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# Shard of a dim whose major part is split by a later mesh dim: what a spec tuple whose
# order differs from mesh order compiles to. Public alternative: none.
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

try:  # the one-process simulation of many ranks (dtp.testing.simulate). Public: none.
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode, maybe_run_for_local_tensor
except ImportError:  # pragma: no cover - older torch
    LocalTensor = LocalTensorMode = None  # type: ignore[assignment,misc]

    def maybe_run_for_local_tensor(fn):  # type: ignore[no-redef]
        """Run ``fn`` once per simulated rank under LocalTensorMode (identity without it)."""
        return fn

try:  # saving through the saved-tensors hooks as an object backward can drop early.
    # Public alternative: ctx.save_for_backward (which cannot be dropped before backward ends).
    from torch._C._autograd import SavedTensor
    from torch._C._autograd import _make_saved_tensor
except ImportError:  # pragma: no cover - older or newer torch without it
    SavedTensor, _make_saved_tensor = None, None  # type: ignore[assignment,misc]

__all__ = [
    "StridedShard", "LocalTensor", "LocalTensorMode", "maybe_run_for_local_tensor", "fake_store",
    "local_tensor", "local_tensors", "is_local_tensor", "flatten_mesh", "unflatten_mesh", "group_timeout",
    "set_group_timeout",
    "current_graph_task_id", "SavedTensor", "make_saved_tensor", "unpack_saved",
    "cpu_flash_attention", "cpu_flash_attention_backward", "cuda_efficient_attention", "global_offset", "local_shape",
    "new_dtensor", "forget_meshes", "run_backward", "disable_dynamo_lazily", "no_donated_buffers",
]


def local_tensor(x: DTensor) -> torch.Tensor:
    """A DTensor's local shard, read as an attribute: no autograd node, no wait on an
    async collective. Public alternative: ``x.to_local()`` (differentiable, and slower)."""
    return x._local_tensor


def new_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: tuple, shape: tuple[int, ...],
                stride: tuple[int, ...]) -> DTensor:
    """A DTensor around ``local`` (aliased through a fresh view, as ``from_local`` does),
    built by DTensor's own constructor with a :class:`DTensorSpec` shared by every call
    of the same mesh *object*, placements, shape, stride and dtype: no autograd node, no
    placement normalisation, no new spec. Only for a ``local`` that no gradient flows
    through (the caller checks); ``local`` must already be on the mesh's device type.
    Public alternative: ``DTensor.from_local(..., run_check=False)`` (about 4x the Python work)."""
    key = (id(mesh), placements, shape, stride, local.dtype)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _MAX_SPECS:
            # A bound, not an LRU: a hit is one dict lookup (measured: 2.1 µs a wrap, 2.3
            # with the lru_cache it replaces; torch 2.13, 2-core CPU).
            _SPECS.clear()
        spec = _SPECS[key] = _dtensor_spec(mesh, placements, shape, stride, local.dtype)
    # requires_grad as from_local under no_grad: a leaf when ``local`` is one. ``__new__``
    # alone: DTensor's ``__init__`` does nothing but sits behind dynamo's disable wrapper,
    # three Python frames per DTensor (measured: a third of a wrap's cost, torch 2.13).
    return DTensor.__new__(DTensor, local.view_as(local), spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]


# The shared specs, keyed by the mesh's id, not the mesh: DeviceMesh's ``__eq__`` and hash
# read its ranks, layout, device type and dim names, never its process groups, so meshes
# over different groups compare equal. Keyed by the mesh (an lru_cache, as it was), a spec
# made for one handed its mesh to DTensors wrapped on an equal other: measured (torch 2.13)
# in a second ``dtp.testing.simulate`` session, ``dtp.shard`` returned DTensors on the first
# session's mesh (its groups destroyed), and ``local_map`` refused to mix them with
# DTensors on the current one; in one session, a DTensor wrapped on ``twin(mesh)`` (equal
# to ``mesh``, groups of its own) landed on ``mesh``. An entry's spec holds its mesh, so
# the id stays that mesh's while the entry lives. Emptied by :func:`forget_meshes`.
_SPECS: dict[tuple, Any] = {}
_MAX_SPECS = 8192


def _dtensor_spec(mesh: DeviceMesh, placements: tuple, shape: tuple[int, ...], stride: tuple[int, ...],
                  dtype: torch.dtype) -> Any:
    # Shared between DTensors: DTensor's dispatch never mutates a spec in place (an
    # in-place op assigns a new one), so one object per signature is safe.
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def forget_meshes() -> None:
    """Drop the cached DTensor specs that hold meshes, for when the meshes' process group
    is destroyed (:func:`dtp.mesh.clear_mesh_cache`): dtp's shared specs, and DTensor's
    sharding-propagation caches (the C++ fast path's and the Python one, this thread's:
    it is thread-local). DTensor's have dtp's old problem: keyed by op schemas whose
    specs compare meshes by equality, their output specs carry the mesh of the call that
    filled them; measured (torch 2.13), ``x * 2`` in a second simulate session returned a
    DTensor on the first session's mesh, also after the Python cache alone was cleared.
    Public alternative: none (``torch.distributed.tensor.debug._clear_sharding_prop_cache``
    is torch's own "recommended way to clear all sharding propagation caches")."""
    _SPECS.clear()
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def run_backward(outputs: Any, grad_outputs: Any, inputs: Any, *, retain_graph: bool = False) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph,
    allow_unused=True)`` straight into the engine: every output (a tensor or a
    ``GradientEdge``) needs its gradient given, of its shape and dtype (the caller's
    contract: a pipeline stage's, checked by the stage that sent it). Measured
    (torch 2.13, 2-core CPU, a 1-layer graph): 30 µs a call against 65 µs through
    ``autograd.grad``, whose Python checks (``_make_grads``, overrides) a pipeline pays
    one to three times per backward action. Public alternative: ``torch.autograd.grad``."""
    from torch.autograd.graph import _engine_run_backward

    return _engine_run_backward(tuple(outputs), tuple(grad_outputs), retain_graph, False, tuple(inputs), True, False)


def local_tensors(t: torch.Tensor) -> dict[int, torch.Tensor] | None:
    """Per-rank tensors of a ``LocalTensor`` (``None`` for any other tensor). Public: none."""
    return getattr(t, "_local_tensors", None)


def is_local_tensor(t: torch.Tensor) -> bool:
    """True for a simulation ``LocalTensor`` (by name: no import of the class needed)."""
    return type(t).__name__ == "LocalTensor"


def fake_store() -> Any:
    """A store for the "fake" process-group backend (dtp.testing.simulate). Public: none
    (torch's own tests use it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D view of a (sub)mesh's dims, sharing its ranks (e.g. the EP view of dp×cp).
    Public alternative: a new ``init_device_mesh`` (new process groups, not a view)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, axis: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A view of ``mesh`` with ``axis`` split row-major into named sub-axes (the ring
    windows of double ring / hybrid attention). Public alternative: none."""
    return mesh._unflatten(axis, sizes, names)


def group_timeout(group: Any) -> Any:
    """How long the collectives of ``group`` (a ProcessGroup) wait for their peers: its
    first backend's option (a ``timedelta``), ``None`` if it has none. Public
    alternative: none."""
    try:
        device = next(iter(group._device_types))
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, StopIteration):
        return None


def set_group_timeout(group: Any, timeout: Any) -> None:
    """Make the collectives of ``group`` wait ``timeout`` (a ``timedelta``). Public
    alternative: ``new_group(timeout=...)`` for a group made by hand; none for the groups
    ``init_device_mesh`` and a mesh's ``_flatten`` / ``_unflatten`` make (they take
    torch's default: 30 min on gloo)."""
    torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


def current_graph_task_id() -> int:
    """The autograd engine's running graph task (-1 outside backward): tells a forward
    use of a parameter from a checkpoint recompute. Public alternative: none."""
    return torch._C._current_graph_task_id()


def make_saved_tensor(t: torch.Tensor) -> object:
    """Save ``t`` through the active saved-tensors hooks (what ``torch.utils.checkpoint``
    uses); the plain tensor when this torch has no such constructor."""
    return _make_saved_tensor(t, is_output=False) if _make_saved_tensor is not None else t


def unpack_saved(saved: object) -> torch.Tensor:
    """The tensor behind :func:`make_saved_tensor`'s result."""
    return saved.unpack() if SavedTensor is not None and isinstance(saved, SavedTensor) else saved  # type: ignore[return-value]


def cpu_flash_attention(q, k, v, causal: bool, scale: float | None = None):
    """``(out, lse)`` of the CPU flash kernel: SDPA's public API does not return the LSE
    that ring attention merges by. Public alternative: none."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def cpu_flash_attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float | None = None):
    """``(dq, dk, dv)`` of the CPU flash kernel given the forward's ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )


def cuda_efficient_attention(q, k, v, causal: bool, scale: float | None = None):
    """The CUDA memory-efficient kernel's outputs (``out, lse, ...``), LSE included."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)


def global_offset(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple) -> tuple[int, ...]:
    """Where this rank's block of a DTensor of global ``shape`` starts (what DCP itself
    uses to name a DTensor's chunk; no public API exposes it)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[1])


def local_shape(shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple) -> tuple[int, ...]:
    """This rank's block shape of a DTensor of global ``shape`` (what from_local needs)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[0])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` (N, K) times their group's ``w[g]`` (G, K, M), group g's rows ending
    at ``offsets[g]`` (int32, cumulative): one grouped-GEMM kernel, differentiable.
    Public alternative: none (torch 2.13 keeps it private; torchtitan calls it too)."""
    return torch._grouped_mm(x, w, offs=offsets)


def grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs here: CUDA, bf16, compute capability 9.0+ (its
    kernel is Hopper's), and every inner dimension a multiple of 8 (16-byte rows)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return all(w.dtype == torch.bfloat16 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 for w in weights)


def dynamo_counters() -> Any:
    """torch.compile's process-wide counters: ``["stats"]["unique_graphs"]`` (graphs
    compiled) and ``["graph_break"]`` (reason -> count), what ``dtp.compiled`` reports.
    Public alternative: ``torch._dynamo.explain`` (one call, not a running count)."""
    from torch._dynamo.utils import counters

    return counters


def no_donated_buffers() -> Any:
    """A context in which AOT autograd compiles graphs whose backward donates no saved
    tensor, and runs a backward twice without refusing (``retain_graph=True``): zero
    bubble's ``I`` then ``W`` over one compiled region (:func:`dtp.compiled.retaining_graph`).
    Public alternative: none (``torch._functorch.config.donated_buffer``)."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(donated_buffer=False)


def disable_dynamo_lazily(fn: Any) -> Any:
    """``torch.compiler.disable(fn)`` that imports ``torch._dynamo`` at its first call, not
    here; dynamo treats a call to it as a graph break and runs ``fn`` eagerly. What
    :func:`dtp.compiled.eager` calls when it is traced before it made its disabled twin
    (dynamo is loaded then). Public alternative: ``torch.compiler.disable``, which imports
    ``torch._dynamo`` (~1 s of CPU) when it wraps."""
    from torch._compile import _disable_dynamo

    return _disable_dynamo(fn)
