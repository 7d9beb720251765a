"""The collectives: each runs on the process group of one named mesh axis and is
recorded (:func:`dtp.comm.comm_log`, the flight record) with the bytes it sends.

Functions take and return *local* tensors (the per-rank shards); the DTensor-level
redistribution rules live in :mod:`dtp.redistribute`. Each has ``async_op=True``, which
returns a :class:`~dtp.comm.CommHandle` whose ``wait()`` yields the result.

Bytes are *sent per rank*, counted as the bandwidth-optimal (ring) algorithms move them:

==============  ================================
all_gather      (n-1) × local input bytes
reduce_scatter  (n-1)/n × local input bytes
all_reduce      2 (n-1)/n × bytes
all_to_all      (n-1)/n × local input bytes
all_to_all_v    rows sent to the other coordinates × bytes per row (uneven splits)
send_recv       bytes of the tensor sent (send_recv_batch: one record per pair)
==============  ================================
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..compiled import eager as _eager
from ..mesh.devices import mesh_device
from .flight import _failure, _record
from .handles import CommHandle
from .link import _link_applies, _link_board

# A collective inside a compiled region (dtp.compiled) is a graph break: it runs eagerly,
# recorded as always, and the region is traced around it (≈0.35 µs per call in an eager
# process, measured; once dynamo is loaded, its disabled twin: 0.55 µs).

__all__ = ["ring_bytes", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "all_to_all_v",
           "exchange_counts", "send_recv", "send_recv_batch", "barrier", "any_rank"]


def _group(mesh: DeviceMesh, axis: str) -> tuple[dist.ProcessGroup, int]:
    names = mesh.mesh_dim_names or ()
    if axis not in names:
        raise ValueError(f"collective on unknown mesh axis {axis!r}; the mesh has {names}")
    return mesh.get_group(axis), mesh.size(names.index(axis))


def _run(kind: str, mesh: DeviceMesh, axis: str, x: torch.Tensor, nbytes: Callable[[int], float],
         post: Callable[[dist.ProcessGroup, int], tuple[object, Callable[[], torch.Tensor]]],
         async_op: bool, tag: str, received: int = 0, route: int = 1) -> torch.Tensor | CommHandle:
    group, n = _group(mesh, axis)
    if n == 1:  # nothing moves: no collective, no record (a ring of one does no send/recv)
        handle = CommHandle(None, None, lambda: x)
        return handle if async_op else handle.wait()
    record = _record(kind, axis, nbytes(n), n, x, async_op, tag)
    link = None
    if _link_applies(axis):  # noted on the board before posting: a peer reads it once this has arrived
        board = _link_board()
        link = (axis, record.bytes, route, board and board.collective(group, kind, record.issued))
    try:
        work, finish = post(group, n)
    except RuntimeError as e:  # a peer already gone: gloo can fail at posting
        raise _failure(record, e) from e
    handle = CommHandle(work, record, finish, link, received, x.device.type)
    return handle if async_op else handle.wait()


def _on_mesh(x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
    """``x``, or a copy on the mesh's device where ``axis``' process group cannot move CPU
    tensors: the small host tensors dtp's strategies reduce or send (a loss, a pipeline
    header) then travel on the device, the only one NCCL moves. A group with a CPU
    backend (gloo; ``"cuda:nccl,cpu:gloo"``) takes them as they are."""
    if mesh.device_type == "cpu" or x.device.type != "cpu":
        return x
    try:  # asked each time, not cached by id(group): a destroyed group's id is reused
        _group(mesh, axis)[0]._get_backend(torch.device("cpu"))
        return x
    except RuntimeError:  # "No backend type associated with device type cpu"
        return x.to(mesh_device(mesh))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


_RING_SHARE = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
               "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n}


def ring_bytes(kind: str, nbytes: int, n: int) -> int:
    """The bytes one rank sends, as the comm log records them, for a ring ``kind``
    (``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``) of ``nbytes`` of
    local input over ``n`` ranks (module docstring's table); :func:`dtp.plan` predicts
    with it.

    >>> ring_bytes("all_reduce", 1000, 4), ring_bytes("all_gather", 1000, 4)
    (1500, 3000)
    """
    return int(round(_RING_SHARE[kind](n) * nbytes))


@_eager
def all_gather(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, dim: int = 0, out: torch.Tensor | None = None,
               async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Concatenate every rank's ``x`` along ``dim`` in axis-coordinate order.

    ``out`` (``dim=0`` only): a contiguous buffer of the gathered shape to gather into,
    so a caller can hand out views of it while the gather is still in flight. On gloo
    over 2 ranks it runs as an all-to-all with the same bytes (:func:`_gloo_all_gather`).

    >>> with simulate(2):
    ...     mesh = make_mesh(dp=2)
    ...     x = dtp.shard(torch.arange(4.0), mesh, P("dp")).to_local()  # rank 0 [0, 1], rank 1 [2, 3]
    ...     rank_values(all_gather(x, mesh, "dp"))
    [tensor([0., 1., 2., 3.]), tensor([0., 1., 2., 3.])]
    """
    x = x.contiguous()
    if out is not None and (dim != 0 or not out.is_contiguous()):
        raise ValueError("all_gather: out= needs dim=0 and a contiguous buffer")

    def post(group: dist.ProcessGroup, n: int):
        nonlocal out
        if out is None:
            out = x.new_empty((n * x.shape[0], *x.shape[1:])) if dim == 0 else x.new_empty((n, *x.shape))
        if n == 2 and dist.get_backend(group) == "gloo":
            work = _gloo_all_gather(x.view(-1), out.view(n, -1), group)
        else:
            work = _single("all_gather")(out.view(-1), x.view(-1), group=group, async_op=True)

        def finish() -> torch.Tensor:
            if dim == 0:
                return out
            stacked = out.movedim(0, dim)  # (..., n, x.shape[dim], ...)
            shape = list(x.shape)
            shape[dim] *= n
            return stacked.reshape(shape)

        return work, finish

    return _run("all_gather", mesh, axis, x, lambda n: ring_bytes("all_gather", _nbytes(x), n), post, async_op, tag)


@_eager
def reduce_scatter(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, dim: int = 0,
                   async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Sum ``x`` over the axis and keep this rank's ``dim``-chunk (by coordinate).

    On gloo it runs as an all-to-all with the same bytes (:func:`_gloo_reduce_scatter`).

    >>> with simulate(2):
    ...     mesh = make_mesh(dp=2)
    ...     x = dtp.shard(torch.arange(4.0), mesh, P("dp")).to_local()  # rank 0 [0, 1], rank 1 [2, 3]
    ...     rank_values(reduce_scatter(x, mesh, "dp"))                  # the sum [2, 4], cut in two
    [tensor([2.]), tensor([4.])]
    """

    def post(group: dist.ProcessGroup, n: int):
        if x.shape[dim] % n:
            raise ValueError(f"reduce_scatter over {axis!r}: dim {dim} of size {x.shape[dim]} does not divide by {n}")
        c = x.shape[dim] // n
        # Bring the n destination chunks to the front so the backend splits on dim 0;
        # what is left, (*x.shape[:dim], c, *x.shape[dim+1:]), is exactly the result.
        inp = x.reshape(*x.shape[:dim], n, c, *x.shape[dim + 1:]).movedim(dim, 0).contiguous()
        if dist.get_backend(group) == "gloo":
            # gloo's reduce-scatter does not run until wait() (its work never completes
            # on its own: measured, torch 2.13), so an "async" one would hide nothing,
            # and waited at once it is slow: 2.6× the all-to-all's time at 2 × 2 MiB,
            # 3.1× at 4 ranks (medians of 41 and 21 alternated calls, loaded machine).
            # The same bytes as an all-to-all, which gloo does run in the background:
            # chunk k goes to coordinate k, and the n chunks that arrive are summed here.
            return _gloo_reduce_scatter(inp, group, n)
        out = x.new_empty(inp.shape[1:])
        # Flat buffers: the chunks are contiguous either way, and LocalTensorMode's
        # reduce-scatter (torch 2.13) mishandles multi-dim ones.
        work = _single("reduce_scatter")(out.view(-1), inp.view(-1), group=group, async_op=True)
        return work, (lambda: out)

    return _run("reduce_scatter", mesh, axis, x, lambda n: ring_bytes("reduce_scatter", _nbytes(x), n), post, async_op, tag)


def _single(kind: str) -> Callable[..., dist.Work | None]:
    """torch's flat-buffer ``all_gather`` / ``reduce_scatter``: ``dist.all_gather_single``
    and ``dist.reduce_scatter_single`` from torch 2.13 on, where the older
    ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are deprecated aliases of
    them; before, only the older names (the lent GPU machine's torch 2.11). Looked up
    at each call, so a wrapper a caller puts on ``dist`` sees dtp's calls too.

    >>> _single("all_gather").__name__ in ("all_gather_single", "all_gather_into_tensor")
    True
    """
    new, old = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}[kind]
    return getattr(dist, new, None) or getattr(dist, old)


def _gloo_reduce_scatter(inp: torch.Tensor, group: dist.ProcessGroup, n: int):
    """Reduce-scatter of ``inp`` (n, c, ...) as an all-to-all (gloo runs that one in the
    background). A rank at either end of the axis sends and receives only its peers'
    chunks — its own is the contiguous rest, read in place — so its receive buffer is
    (n-1)/n of the input (1/2 at n = 2, FSDP2's reduce-scatter output size) instead of
    all of it; a middle rank still sends itself its chunk. Every rank passes split sizes,
    so all take gloo's alltoallv (alltoall and alltoallv do not pair up)."""
    r = group.rank()
    if r in (0, n - 1):
        send = inp[1:] if r == 0 else inp[:-1]
        splits = [int(k != r) for k in range(n)]
    else:
        send, splits = inp, [1] * n
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, output_split_sizes=splits, input_split_sizes=splits, group=group,
                                  async_op=True)

    edge = send is not inp

    def chunk(k: int) -> torch.Tensor:  # coordinate k's contribution to this rank's chunk
        if edge and k == r:
            return inp[r]
        return recv[k - 1 if edge and r == 0 else k]

    def finish() -> torch.Tensor:
        # Summed in coordinate order, as the whole-size form did: at n = 2 the same bits.
        chunks = [chunk(k) for k in range(n)]
        out = chunks[0] + chunks[1]
        for c in chunks[2:]:
            out += c
        return out

    return work, finish


def _gloo_all_gather(x: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup) -> object:
    """All-gather of the flat ``x`` into the rows of ``out`` (2, x.numel()) over 2 ranks as
    an all-to-all, which gloo writes straight into ``out``: each rank sends ``x`` as it
    is and receives its peer's row; its own is copied here. Same bytes as the ring.

    Why: gloo's all-gather stages the whole output in a buffer of its own and copies it
    out (torch 2.13, ``ProcessGroupGloo``'s allgather; ``torch.profiler`` shows it as a
    full-size ``aten::empty`` on the gloo thread). While a ZeRO-3 prefetch waits for a
    late peer that is a second whole bucket beside the step's peak — 3 MiB of llama
    "small" at dp=2, its whole excess over FSDP2's peak; and waited at once (sequence
    parallel's gathers) the staging costs time: 1.7× the all-to-all's at 2 × 2 MiB
    (median of 41 alternated calls, loaded machine). Over more ranks the all-to-all
    would need ``x`` repeated per receiver, as large as gloo's staging and held for as
    long as the gather is in flight, so they keep the all-gather."""
    r = group.rank()
    out[r].copy_(x)
    splits = [int(k != r) for k in range(2)]
    return dist.all_to_all_single(out[1 - r:2 - r], x.view(1, -1), output_split_sizes=splits,
                                  input_split_sizes=splits, group=group, async_op=True)


@_eager
def all_reduce(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, op: str = "sum", async_op: bool = False,
               tag: str = "") -> torch.Tensor | CommHandle:
    """Reduce ``x`` over the axis with ``op`` ("sum" or "max") into a new tensor.

    >>> with simulate(2):
    ...     mesh = make_mesh(dp=2)
    ...     x = dtp.shard(torch.arange(4.0), mesh, P("dp")).to_local()  # rank 0 [0, 1], rank 1 [2, 3]
    ...     handle = all_reduce(x, mesh, "dp", op="max", async_op=True)  # posted; wait() when needed
    ...     rank_values(all_reduce(x, mesh, "dp")), rank_values(handle.wait())
    ([tensor([2., 4.]), tensor([2., 4.])], [tensor([2., 3.]), tensor([2., 3.])])
    """
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    out = _on_mesh(x.detach(), mesh, axis).clone(memory_format=torch.contiguous_format)

    def post(group: dist.ProcessGroup, n: int):  # a host tensor comes back to the host
        return dist.all_reduce(out, op=reduce_op, group=group, async_op=True), (lambda: out.to(x.device))

    return _run("all_reduce", mesh, axis, x, lambda n: ring_bytes("all_reduce", _nbytes(x), n), post, async_op, tag)


@_eager
def all_to_all(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, split_dim: int, concat_dim: int,
               async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Split ``x`` into n chunks along ``split_dim`` (chunk k goes to coordinate k) and
    concatenate what arrives along ``concat_dim`` — Shard(concat_dim) → Shard(split_dim).

    >>> with simulate(2):
    ...     mesh = make_mesh(cp=2)
    ...     x = dtp.shard(torch.arange(8.0).view(2, 4), mesh, P(None, "cp")).to_local()  # columns split
    ...     rank_values(all_to_all(x, mesh, "cp", split_dim=0, concat_dim=1))           # rows split
    [tensor([[0., 1., 2., 3.]]), tensor([[4., 5., 6., 7.]])]
    """

    def post(group: dist.ProcessGroup, n: int):
        if x.shape[split_dim] % n:
            raise ValueError(
                f"all_to_all over {axis!r}: dim {split_dim} of size {x.shape[split_dim]} does not divide by {n}"
            )
        c = x.shape[split_dim] // n
        inp = x.reshape(*x.shape[:split_dim], n, c, *x.shape[split_dim + 1:]).movedim(split_dim, 0).contiguous()
        out = torch.empty_like(inp)
        work = dist.all_to_all_single(out, inp, group=group, async_op=True)

        def finish() -> torch.Tensor:
            # out[k] is coordinate k's chunk, the k-th block along concat_dim: put the
            # block index right in front of concat_dim and fold the two together.
            shape = list(inp.shape[1:])
            shape[concat_dim] *= n
            return out.movedim(0, concat_dim).reshape(shape)

        return work, finish

    return _run("all_to_all", mesh, axis, x, lambda n: ring_bytes("all_to_all", _nbytes(x), n), post, async_op, tag)


def _check_splits(name: str, counts: Sequence[int], n: int) -> list[int]:
    out = list(counts)
    if len(out) != n or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in out):
        raise ValueError(f"all_to_all_v: {name} must be {n} ints >= 0 (one per axis coordinate), got {counts!r}")
    return out


@_eager
def all_to_all_v(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, send_counts: Sequence[int],
                 recv_counts: Sequence[int], async_op: bool = False, tag: str = "") -> torch.Tensor | CommHandle:
    """Send rows of ``x`` (dim 0) to each coordinate of ``axis``, ``send_counts[k]`` to
    coordinate k in order; return the rows received, concatenated in coordinate order
    (``recv_counts[k]`` from coordinate k) — the uneven all-to-all of expert parallel.

    Records ``all_to_all_v``: the rows sent to *other* coordinates × bytes per row. Every
    rank's ``recv_counts[k]`` must equal coordinate k's ``send_counts`` for it (exchange
    them with :func:`exchange_counts`); a mismatch is the backend's error or a hang.

    Raises: ``ValueError`` when a count list is not one int >= 0 per coordinate or
    ``send_counts`` does not sum to ``x.shape[0]`` (before any collective, on this rank).
    """
    group, n = _group(mesh, axis)
    send, recv = _check_splits("send_counts", send_counts, n), _check_splits("recv_counts", recv_counts, n)
    if x.dim() == 0 or sum(send) != x.shape[0]:
        raise ValueError(f"all_to_all_v: send_counts {send} must sum to the rows of x (dim 0), "
                         f"got shape {tuple(x.shape)}")
    x = x.contiguous()  # gloo: "Tensors must be contiguous" (measured)
    me = mesh.get_local_rank(axis)
    row = math.prod(x.shape[1:]) * x.element_size()

    def post(group: dist.ProcessGroup, n: int):
        out = x.new_empty((sum(recv), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group,
                                      async_op=True)
        return work, (lambda: out)

    return _run("all_to_all_v", mesh, axis, x, lambda n: (sum(send) - send[me]) * row, post, async_op, tag)


@_eager
def exchange_counts(counts: torch.Tensor, mesh: DeviceMesh, axis: str, *, async_op: bool = False,
                    tag: str = "counts") -> torch.Tensor | CommHandle:
    """Tell each coordinate how many rows it will get: ``counts[k]`` (int64, dim 0 one
    entry per coordinate, any trailing shape) goes to coordinate k; returns the same shape
    with ``[k]`` what coordinate k sends here. The split sizes of :func:`all_to_all_v`.

    Records an ``all_to_all`` of (n-1) × ``counts[0]``'s bytes. Reading the result on the
    host (``.tolist()``, which :func:`all_to_all_v`'s split sizes need) is expert
    parallel's one host sync per layer: on an accelerator it waits for the exchange.

    Raises: ``ValueError`` when ``counts`` is not int64 with ``counts.shape[0]`` = the axis size.
    """
    _, n = _group(mesh, axis)
    if counts.dtype != torch.int64 or counts.dim() == 0 or counts.shape[0] != n:
        raise ValueError(f"exchange_counts: counts must be int64 with dim 0 of size {n} (the {axis!r} axis), "
                         f"got {counts.dtype} {tuple(counts.shape)}")
    return all_to_all(counts, mesh, axis, split_dim=0, concat_dim=0, async_op=async_op, tag=tag)


@_eager
def send_recv(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, shift: int = 1, async_op: bool = False,
              tag: str = "") -> torch.Tensor | CommHandle:
    """Ring step: send ``x`` to coordinate ``c + shift`` and receive from ``c - shift``
    (one pair of :func:`send_recv_batch`).

    >>> mesh = make_mesh(tp=1)  # a ring of one: this rank hears itself (tests/test_comm.py runs 3 ranks)
    >>> send_recv(torch.ones(2), mesh, "tp").tolist()
    [1.0, 1.0]
    """
    handle, = _send_recv_batch([(x, shift)], mesh, axis, tag, async_op)
    return handle if async_op else handle.wait()


@_eager
def send_recv_batch(pairs: Sequence[tuple[torch.Tensor, int]], mesh: DeviceMesh, axis: str, *,
                    tag: str = "") -> list[CommHandle]:
    """Several ring steps posted as one batch: for each ``(x, shift)``, send ``x`` to
    coordinate ``c + shift`` and receive the same shape from ``c - shift``. One handle
    per pair (always asynchronous), each recorded as a ``send_recv`` of its bytes on its
    way round the ring (``shift`` ≥ 0 or < 0: what ``simulated_link(neighbours=True)``
    routes by).

    Why one batch: NCCL runs one ``batch_isend_irecv`` as one group (``ncclGroupStart``
    / ``End``), and two batches on one communicator one after the other on its stream,
    so a bidirectional ring's two directions (:mod:`dtp.ops.tp_rings`) only move at once
    when they are posted together. gloo posts each message on its own either way; a
    handle then waits for its own pair only. Where the backend coalesces the batch into
    one work (NCCL), every handle waits for that work.

    >>> mesh = make_mesh(tp=1)  # a ring of one: nothing moves (tests/test_comm.py runs 3 ranks)
    >>> right, left = send_recv_batch([(torch.ones(2), 1), (torch.zeros(2), -1)], mesh, "tp")
    >>> right.wait().tolist(), left.wait().tolist()
    ([1.0, 1.0], [0.0, 0.0])
    """
    return _send_recv_batch(pairs, mesh, axis, tag, True)


def _send_recv_batch(pairs: Sequence[tuple[torch.Tensor, int]], mesh: DeviceMesh, axis: str, tag: str,
                     async_op: bool) -> list[CommHandle]:
    pairs = [(x.contiguous(), shift) for x, shift in pairs]
    group, n = _group(mesh, axis)
    if not pairs:
        return []
    if n == 1:  # nothing moves: no message, no record (a ring of one does no send/recv)
        return [CommHandle(None, None, lambda x=x: x) for x, _ in pairs]
    records = [_record("send_recv", axis, _nbytes(x), n, x, async_op, tag) for x, _ in pairs]
    me = dist.get_rank(group)
    outs = [torch.empty_like(x) for x, _ in pairs]
    ops = []
    board = _link_board() if _link_applies(axis) else None
    arrivals: list[Callable[[], float | None] | None] = []
    for (x, shift), out, record in zip(pairs, outs, records):
        to, frm = (me + shift) % n, (me - shift) % n
        ops += [dist.P2POp(dist.isend, x, dist.get_global_rank(group, to), group),
                dist.P2POp(dist.irecv, out, dist.get_global_rank(group, frm), group)]
        if board is not None:  # batch_isend_irecv posts with tag 0
            board.send(group, to, 0, _nbytes(x), record.issued)
        arrivals.append(board and board.recv(group, frm, 0, _nbytes(x), record.issued))
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as e:  # a peer already gone: gloo can fail at posting
        for record in records[1:]:  # the batch failed: each record is marked so, the first named
            record.failed = True
        raise _failure(records[0], e) from e
    linked = _link_applies(axis)
    handles = []
    for k, ((x, shift), out, record) in enumerate(zip(pairs, outs, records)):
        # One work per op (gloo: this pair's two), or the batch's one coalesced work (NCCL),
        # which every handle waits for (waiting an NCCL work twice is harmless).
        mine = works[2 * k:2 * k + 2] if len(works) == len(ops) else works
        link = (axis, record.bytes, 1 if shift >= 0 else -1, arrivals[k]) if linked else None
        handles.append(CommHandle(_Works(mine), record, lambda out=out: out, link, _nbytes(x), x.device.type))
    return handles


class _Works:
    """Several backend works that complete together (a send and a receive)."""

    def __init__(self, works: Sequence[object]):
        self.works = list(works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def get_future(self) -> torch.futures.Future:
        """Completes when the send and the receive both have (so the comm log records
        the transfer's real end, not when someone waited on it)."""
        return torch.futures.collect_all([w.get_future() for w in self.works])


@_eager
def barrier(*, tag: str = "") -> None:
    """Wait until every rank of the default group reaches this call (recorded, 0 bytes).

    For work outside the mesh's axes, such as :mod:`dtp.checkpoint`'s rename after every
    rank has written. A world of one returns at once.

    >>> barrier()
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    record = _record("barrier", "world", 0, dist.get_world_size(), torch.empty(0), False, tag)
    dist.barrier()
    record.completed = time.perf_counter()


@_eager
def any_rank(flag: bool, mesh: DeviceMesh, *, tag: str = "") -> bool:
    """``True`` on every rank if ``flag`` is on any rank of the default group: one
    1-element max all-reduce on ``mesh``'s device (recorded on the ``world`` axis, 4 bytes).
    So ranks that each saw an event at their own moment (a signal) act on it at the same
    step. A world of one returns ``flag``.

    >>> any_rank(True, make_mesh(dp=1))
    True
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return bool(flag)
    x = torch.tensor([int(flag)], dtype=torch.int32, device=mesh_device(mesh))
    n = dist.get_world_size()
    record = _record("all_reduce", "world", ring_bytes("all_reduce", _nbytes(x), n), n, x, False, tag)
    try:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    except RuntimeError as e:  # a peer already gone
        raise _failure(record, e) from e
    record.completed = time.perf_counter()
    return bool(x.item())
