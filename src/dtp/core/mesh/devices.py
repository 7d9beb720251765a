"""Named device meshes: device/backend detection and process-group set-up.

A mesh is a plain ``torch.distributed.device_mesh.DeviceMesh`` whose dimensions carry
names (``dp``, ``cp``, ``tp`` …). Keyword order is mesh order, outer to inner, so the
last axis holds neighbouring ranks (the fast links: tensor parallel belongs there).
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import re
import weakref
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._rules import is_positive_int
from .shape import axis_names  # torch-free: the layouts check against a MeshShape too
from .._torch import flatten_mesh, forget_meshes, group_timeout, set_group_timeout

__all__ = ["make_mesh", "detect_device", "mesh_device", "axis_names", "axis_sizes", "axis_size", "coordinates", "all_coordinates", "axis_coordinate",
           "block_index", "flatten_axes", "clear_mesh_cache"]

_BACKEND_FOR_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
_AXIS_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# make_mesh is idempotent: the same request on the same process group returns the same
# mesh, so tests and notebooks that call it repeatedly do not pile up process groups.
_MESH_CACHE: dict[tuple[Any, ...], DeviceMesh] = {}


def _npu_available() -> bool:
    """True when ``torch_npu`` imports and reports a device.

    ``torch_npu`` is optional and heavy; it is imported lazily, here only, and any
    failure to import or initialise it (missing package, missing CANN libraries,
    driver errors) means "no npu".
    """
    try:
        importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError):
        return False
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except (RuntimeError, OSError):
        return False


def detect_device(device: str | None = None) -> tuple[str, str]:
    """Return ``(device_type, backend)`` for ``device`` or for this machine.

    cuda → nccl, npu (when ``torch_npu`` imports) → hccl, otherwise cpu → gloo.

    >>> detect_device("cpu")
    ('cpu', 'gloo')
    """
    if device is None:
        if torch.cuda.is_available():
            device = "cuda"
        elif _npu_available():
            device = "npu"
        else:
            device = "cpu"
    else:
        device_type = device.split(":", 1)[0] if isinstance(device, str) else None  # "cuda:1" → "cuda"
        if device_type not in _BACKEND_FOR_DEVICE:
            raise ValueError(
                f"make_mesh: unsupported device {device!r}; expected one of {sorted(_BACKEND_FOR_DEVICE)}"
            )
        present = {"cuda": torch.cuda.is_available, "npu": _npu_available}.get(device_type, lambda: True)
        if not present():
            raise ValueError(
                f"make_mesh: device {device!r} asked for, but this machine has no usable {device_type} "
                f"device ({'torch.cuda.is_available() is False' if device_type == 'cuda' else 'torch_npu reports none'}); "
                "use device='cpu', or leave device out to detect it"
            )
    device_type = device.split(":", 1)[0]
    return device_type, _BACKEND_FOR_DEVICE[device_type]


def _check_axes(axes: dict[str, int]) -> None:
    if not axes:
        raise ValueError("make_mesh: give at least one named axis, e.g. make_mesh(dp=2)")
    for name, size in axes.items():
        if not _AXIS_NAME.match(name):
            raise ValueError(f"make_mesh: axis name {name!r} must be a Python identifier")
        if not is_positive_int(size):
            raise ValueError(f"make_mesh: axis {name!r} has size {size!r}; sizes are integers >= 1")


def _check_timeout(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"make_mesh: timeout must be a number of seconds > 0 (or a timedelta), got {timeout!r}")
    return datetime.timedelta(seconds=seconds)


def _restart_store(timeout: datetime.timedelta | None) -> dist.Store | None:
    """After torchrun's agent restarted the ranks (``--max-restarts``): the agent's store,
    under a prefix of this attempt. torch 2.13's ``env://`` connects workers to the agent's
    store without one ("we create a new TCPStore for every retry"), but the standalone
    rendezvous keeps one store across attempts: the restarted ranks read the dead
    attempt's gloo addresses and fail to connect (measured: ``connectFullMesh ...
    Connection refused`` on every restart). ``None`` on a first attempt."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False,
                           timeout=timeout or datetime.timedelta(minutes=5))
    return dist.PrefixStore(f"dtp/attempt_{attempt}", client)


def _ensure_process_group(backend: str, world_size: int, timeout: datetime.timedelta | None = None) -> None:
    """Initialise the default process group unless torchrun (or the user) already did.

    ``timeout`` bounds every collective of the group (and the rendezvous). Measured on
    torch 2.13 with gloo on one machine: a collective whose peer is SIGKILLed raises
    ``RuntimeError`` ("Connection reset by peer" / "Connection closed by peer") within
    0.01-0.6 s on every surviving rank (2, 3 and 4 ranks; all_reduce and an async
    all_gather), whatever the timeout; one whose peer stalls (sleeps) raises after the
    timeout to within 0.02 s on every other rank ("Timed out waiting 3000ms for recv
    operation to complete", "send" on some ranks of 3). Without a timeout gloo waits 30 min.
    """
    if dist.is_initialized():
        return
    kwargs = {} if timeout is None else {"timeout": timeout}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(
                f"make_mesh: mesh has {world_size} devices but WORLD_SIZE={env_world}; "
                f"the product of the axis sizes must equal the world size"
            )
        store = _restart_store(kwargs.get("timeout"))
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=env_world)
        dist.init_process_group(backend, **kwargs)
        return
    if world_size != 1:
        raise ValueError(
            f"make_mesh: mesh has {world_size} devices but no process group is initialised and no "
            "RANK/WORLD_SIZE is set; launch with torchrun (or `dtp train --nproc N`), "
            "use dtp.testing.run(..., world_size=N), or make a mesh of size 1"
        )
    # A single process (a notebook, a script): an in-memory store, no networking.
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def make_mesh(*, device: str | None = None, timeout: float | datetime.timedelta | None = None,
              **axes: int) -> DeviceMesh:
    """Build a named :class:`DeviceMesh`; keyword order is mesh order (outer → inner).

    Detects the device and backend (see :func:`detect_device`), initialises the default
    process group from the environment when needed, and accepts one that torchrun or the
    user already initialised. The product of the axis sizes must equal the world size.

    - `timeout`: seconds (or a ``timedelta``) a collective may wait for its peers before
      it fails with :class:`dtp.comm.CollectiveError`; default torch's (30 min on gloo).
      Applies when this call creates the process group; one that already exists keeps its own.

    Raises: ``ValueError`` for bad axes, a timeout that is not > 0, or a world size the axes do not fill.

    >>> mesh = make_mesh(dp=1, tp=1)        # on a single process
    >>> mesh.mesh_dim_names
    ('dp', 'tp')
    """
    _check_axes(axes)
    wait = _check_timeout(timeout)
    device_type, backend = detect_device(device)
    n = math.prod(axes.values())
    if dist.is_initialized() and dist.get_world_size() != n:
        shape = " × ".join(f"{k}={v}" for k, v in axes.items())
        raise ValueError(
            f"make_mesh: {shape} = {n} devices, but the world size is {dist.get_world_size()}; "
            f"the product of the axis sizes must equal the world size"
        )
    _ensure_process_group(backend, n, wait)
    key = (device_type, tuple(axes.items()), id(dist.group.WORLD))
    mesh = _MESH_CACHE.get(key)
    if mesh is None:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        mesh = init_device_mesh(device_type, tuple(axes.values()), mesh_dim_names=tuple(axes))
        _MESH_CACHE[key] = bounded(mesh)
    return mesh


def bounded(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``, each of whose process groups waits for its peers as long as the default
    group does (``make_mesh(timeout=...)``, ``dtp train --timeout``). The groups a
    DeviceMesh makes for its dims, views and twins otherwise take torch's default — 30
    min on gloo — whatever the world's: measured on torch 2.13, ``make_mesh(dp=2, tp=2,
    timeout=3)`` with a stalled tp peer waited 25 s (as long as the peer slept) over tp.
    (A dim that spans the whole world reuses the world's group, so dp 2 alone never showed it.)

    >>> bounded(make_mesh(dp=1)).mesh_dim_names
    ('dp',)
    """
    world = group_timeout(dist.group.WORLD) if dist.is_initialized() else None
    if world is not None:
        for group in mesh.get_all_groups():
            if group_timeout(group) != world:
                set_group_timeout(group, world)
    return mesh


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``: ``cpu``, or the mesh's device type
    at the current index (``cuda:0`` …; :func:`make_mesh` set it from ``LOCAL_RANK``).

    Where dtp puts what it creates (parameters, optimizer state, master weights, batches),
    world 1 included: a one-device run on a GPU computes there, not on the CPU.

    >>> mesh_device(make_mesh(dp=1))
    device(type='cpu')
    """
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(mesh.device_type, index)


def clear_mesh_cache() -> None:
    """Forget the meshes :func:`make_mesh` built; call it when their process group is
    destroyed, so the next ``make_mesh`` builds on the new one (and DTensors wrapped
    afterwards, or made by DTensor ops, get the new meshes, not equal old ones:
    :func:`dtp.core._torch.forget_meshes`)."""
    _MESH_CACHE.clear()
    _SUB_MESHES.clear()
    _TWINS.clear()
    forget_meshes()


# Keyed by the mesh's id (the entry holds the mesh, so the id stays its own), not by the
# mesh: DeviceMesh equality ignores process groups, and twin(mesh) == mesh (measured,
# torch 2.13). Keyed by the mesh, twin(twin(mesh)) was the twin itself and
# sub_mesh(twin(mesh), names) was mesh's sub-mesh, over mesh's groups.
_TWINS: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def twin(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh over the same ranks and axes as ``mesh`` (a whole mesh from
    :func:`make_mesh`) with process groups of its own, for collectives another thread
    issues beside this one's (a communication stream, :mod:`dtp.ops.moe_pipe`): gloo and
    NCCL match a group's collectives by issue order, so two threads must not share one.
    Built on first use by every rank at the same point (each rank creates every group,
    in one order, through the default group's store); cached.

    Raises: ``ValueError`` for a mesh that is not the whole world.

    >>> twin(make_mesh(dp=1)).mesh_dim_names
    ('dp',)
    """
    hit = _TWINS.get(id(mesh))
    if hit is not None:
        return hit[1]
    grid = mesh.mesh
    if grid.numel() != dist.get_world_size():
        raise ValueError(f"twin: needs a mesh over the whole world ({dist.get_world_size()} ranks), got "
                         f"{grid.numel()}")
    me, groups = dist.get_rank(), []
    for d in range(grid.dim()):
        mine = None
        for row in grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist():
            group = dist.new_group(row)  # every rank creates every group, in this order
            if me in row:
                mine = group
        groups.append(mine)
    made = bounded(DeviceMesh.from_group(groups, mesh.device_type, mesh=grid, mesh_dim_names=mesh.mesh_dim_names))
    _TWINS[id(mesh)] = (mesh, made)
    return made


# By the mesh's id, as _TWINS (and for the same reason).
_SUB_MESHES: dict[tuple[int, tuple[str, ...]], tuple[DeviceMesh, DeviceMesh]] = {}


def sub_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """``mesh[names]``, one object per mesh and names: DTensors on equal but distinct
    sub-mesh objects do not mix (a pipeline stage's mesh is ``mesh`` without ``pp``).

    >>> sub_mesh(make_mesh(dp=1, tp=1), ("tp",)) is sub_mesh(make_mesh(dp=1, tp=1), ("tp",))
    True
    """
    key = (id(mesh), tuple(names))
    hit = _SUB_MESHES.get(key)
    if hit is None:
        hit = _SUB_MESHES[key] = (mesh, mesh[tuple(names)])
    return hit[1]


def axis_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """``{axis: size}`` in mesh order.

    >>> axis_sizes(make_mesh(dp=1, tp=1))
    {'dp': 1, 'tp': 1}
    """
    # Asked 100-200 times a step under tp (4.7 µs each: mesh.size per axis); a mesh's shape
    # never changes, so it is read once per mesh. Keyed by id, the entry leaves with the
    # mesh (weakref.finalize), so a later mesh at a reused address never reads it.
    got = _SIZES.get(id(mesh))
    if got is None:
        got = {name: mesh.size(i) for i, name in enumerate(axis_names(mesh))}
        try:
            weakref.finalize(mesh, _SIZES.pop, id(mesh), None)
        except TypeError:  # an object without weak references: asked each time
            return got
        _SIZES[id(mesh)] = got
    return dict(got)


_SIZES: dict[int, dict[str, int]] = {}


def coordinates(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's ``{axis: coordinate}`` (per-rank ints under LocalTensorMode).

    >>> coordinates(make_mesh(dp=1, tp=1))
    {'dp': 0, 'tp': 0}
    """
    return dict(zip(axis_names(mesh), mesh.get_coordinate()))


def all_coordinates(mesh: DeviceMesh) -> list[dict[str, int]]:
    """Every mesh position's ``{axis: coordinate}``, in flat (row-major) order: entry i
    belongs to rank ``mesh.mesh.reshape(-1)[i]``.

    >>> all_coordinates(make_mesh(dp=1, tp=1))
    [{'dp': 0, 'tp': 0}]
    """
    names = axis_names(mesh)
    shape = tuple(mesh.mesh.shape)
    coords = torch.unravel_index(torch.arange(math.prod(shape)), shape)
    return [dict(zip(names, map(int, c))) for c in zip(*coords)]


def block_index(mesh: DeviceMesh, axes: Sequence[str], coords: Mapping[str, int] | None = None) -> int:
    """Which of the ``prod(sizes of axes)`` blocks a rank holds when ``axes`` split a dim:
    its coordinates read as a mixed-radix number, ``axes[0]`` most significant.

    ``coords`` defaults to this rank's :func:`coordinates`; pass another rank's to ask
    about it. ``()`` gives 0.

    >>> block_index(make_mesh(dp=1, tp=1), ("tp", "dp"))
    0
    >>> block_index(make_mesh(dp=1, tp=1), ("dp", "tp"), {"dp": 0, "tp": 0})
    0
    """
    sizes = axis_sizes(mesh)
    coord = coordinates(mesh) if coords is None else coords
    idx = 0
    for a in axes:
        idx = idx * sizes[a] + coord[a]
    return idx


def axis_size(mesh: DeviceMesh, axis: str) -> int:
    """Size of the named mesh axis.

    >>> axis_size(make_mesh(dp=1), "dp")
    1
    """
    names = mesh.mesh_dim_names or ()
    if axis not in names:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {names}")
    return mesh.size(names.index(axis))


def axis_coordinate(mesh: DeviceMesh, axis: str) -> int:
    """This rank's coordinate along the named axis (a per-rank int under LocalTensorMode)."""
    names = mesh.mesh_dim_names or ()
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("this rank is not part of the mesh")
    return coord[names.index(axis)]


def flatten_axes(mesh: DeviceMesh, axes: tuple[str, ...], name: str | None = None) -> DeviceMesh:
    """A 1-D view of several (adjacent, in mesh order) axes, e.g. the EP view of ``dp×cp``.

    >>> ep = flatten_axes(make_mesh(dp=1, cp=1), ("dp", "cp"))
    >>> ep.mesh_dim_names
    ('dp_cp',)
    """
    for axis in axes:
        axis_size(mesh, axis)
    name = name or "_".join(axes)
    if len(axes) == 1:
        return mesh[axes[0]]
    return bounded(flatten_mesh(mesh[axes], name))
