"""The expert path of an MoE block under expert parallel, chunk by chunk: MindSpeed's
pipe-experts (the all-to-all hidden behind the expert FFN), multi-data, multi-stream, and
experts split over tensor parallel.

**Chunks.** The rows a rank routes are cut into chunks: one per local expert, each split
again into ``multi_data`` pieces (``--pipe-experts-multi-data N``; the only way to get more
than one chunk when ``ep = num_experts``). Chunk c holds, from every source rank, the
rows of one local expert (piece j of them), so it needs no regrouping and one expert's
weights. The chunk sizes follow from the one counts exchange every layer does (splitting
a count into pieces is arithmetic both sides do alike): no extra host sync.

**Each chunk's journey** is a list of collectives, each a *leg*: in, the ``ep``
all-to-all to the experts' rank (and, with experts split over ``tp``, an all-gather of
the tp peers' rows, since each tp rank sends a 1/tp slice); the chunk's expert FFN; out,
the tp reduce-scatter of the row-parallel partial sums and the ``ep`` all-to-all home.
Backward is the same journey for the gradients (the transpose of an all-to-all is the
reverse all-to-all, of an all-gather a reduce-scatter), so one engine runs both.

**Engines**, chosen by ``layouts.expert``:

================  ==================================================================
serial            ``pipe_experts=False``: each leg waited for at once (no overlap)
pipelined         ``pipe_experts=True``: every chunk's first leg posted up front; the
                  next chunk's remaining in-legs posted before this chunk computes;
                  out-legs posted as soon as their input exists. All from the calling
                  thread, in an order that depends only on the exchanged counts.
stream            ``multi_stream=True``: one communication stream (a thread running the
                  legs one after another on a :func:`~dtp.mesh.twin` of the mesh) for
                  the ep *and* tp legs, so an ep all-to-all and a tp all-gather /
                  reduce-scatter never run at the same time (MindSpeed's
                  ``--pipe-experts-multi-stream``, which avoids link conflicts on 910C);
                  compute overlaps both.
================  ==================================================================

Why the calling thread in ``pipelined``: gloo and NCCL match a group's collectives by
issue order, and the data-parallel gradient reductions run over ``ep`` too; a second
thread posting on the same group crosses them (measured, gloo: "Received data size
doesn't match expected size"). The stream therefore runs on groups of its own.

Numerics equal the unpipelined layer: the FFN is row-wise, so computing it chunk by
chunk moves no row's arithmetic; only an expert's weight gradient is summed over its
``multi_data`` pieces. Unlike MindSpeed (where pipe-experts stops working once experts
are fused into a grouped GEMM, and does not support dropless) this works dropless and
with capacity.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..core import comm
from ..core.mesh.devices import axis_names, axis_size, flatten_axes, twin
from . import lanes, moe_dispatch

__all__ = ["Chunks", "chunks", "expert_path", "Stream"]


def _piece(n: int, parts: int, j: int) -> tuple[int, int]:
    """(offset, length) of piece j when n rows are split into ``parts`` near-equal pieces."""
    q, r = divmod(n, parts)
    return j * q + min(j, r), q + (j < r)


@dataclass(frozen=True)
class Chunks:
    """One layer's chunks on one rank: chunk c is local expert ``expert[c]``'s piece
    ``c % multi_data``, of which this rank sends its tp slice."""

    expert: tuple[int, ...]  # local expert of each chunk
    rows: tuple[torch.Tensor, ...]  # per chunk: the sorted rows it sends (grouped by destination)
    send: tuple[tuple[int, ...], ...]  # per chunk: rows to each ep coordinate
    recv: tuple[tuple[int, ...], ...]  # per chunk: rows from each ep coordinate
    tp_rows: tuple[tuple[int, ...], ...]  # per chunk: rows each tp peer received (its recv's sum)


def chunks(p: Any, multi_data: int, tp: int = 1, tp_rank: int = 0) -> Chunks:
    """Cut a layer's dispatch into chunks (local expert major, then piece; each piece's
    block from a source split again over ``tp``, this rank sending slice ``tp_rank``).
    Rows are sorted by global expert id ``d·L + l`` (destination d, its local expert l).

    >>> import types
    >>> p = types.SimpleNamespace(send_counts=((2, 1), (0, 3)), recv_counts=((2, 1), (1, 1)))
    >>> c = chunks(p, 2)
    >>> c.expert, [r.tolist() for r in c.rows], c.send, c.recv
    ((0, 0, 1, 1), [[0], [1], [2, 3, 4], [5]], ((1, 0), (1, 0), (1, 2), (0, 1)), ((1, 1), (1, 0), (1, 1), (0, 0)))
    >>> [r.tolist() for r in chunks(p, 1, tp=2, tp_rank=1).rows]  # the second half of each block
    [[1], [5]]
    """
    send, recv = p.send_counts, p.recv_counts
    local = len(send[0])
    flat = [n for row in send for n in row]
    start = [sum(flat[:g]) for g in range(len(flat))]
    expert, rows, sends, recvs, tp_rows = [], [], [], [], []

    def sliced(n: int, j: int, t: int) -> tuple[int, int]:  # piece j, then tp slice t of it
        off, m = _piece(n, multi_data, j)
        off2, k = _piece(m, tp, t)
        return off + off2, k

    for l in range(local):
        for j in range(multi_data):
            parts = [sliced(row[l], j, tp_rank) for row in send]
            idx = [torch.arange(start[d * local + l] + off, start[d * local + l] + off + n)
                   for d, (off, n) in enumerate(parts)]
            expert.append(l)
            rows.append(torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long))
            sends.append(tuple(n for _, n in parts))
            recvs.append(tuple(sliced(row[l], j, tp_rank)[1] for row in recv))
            tp_rows.append(tuple(sum(sliced(row[l], j, t)[1] for row in recv) for t in range(tp)))
    return Chunks(tuple(expert), tuple(rows), tuple(sends), tuple(recvs), tuple(tp_rows))


def _ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


# ------------------------------------------------------------------ legs

Leg = Callable[[torch.Tensor, bool], "torch.Tensor | comm.CommHandle"]


@dataclass(frozen=True)
class _Group:
    mesh: DeviceMesh
    axis: str


def _a2a(g: _Group, send: tuple[int, ...], recv: tuple[int, ...], tag: str) -> Leg:
    def leg(x: torch.Tensor, async_op: bool):
        return comm.all_to_all_v(x.contiguous(), g.mesh, g.axis, send_counts=list(send), recv_counts=list(recv),
                                 async_op=async_op, tag=tag)
    return leg


class _Mapped:
    """A handle whose result is ``fn`` of another's (unpadding after the collective)."""

    def __init__(self, handle: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._handle, self._fn = handle, fn

    def wait(self) -> torch.Tensor:
        return self._fn(self._handle.wait())


def _gather(g: _Group, sizes: tuple[int, ...], me: int, tag: str) -> Leg:
    """All-gather this tp rank's rows (``sizes[me]``) with its peers', padded to the
    largest (the sizes are known on every rank), unpadded in rank order."""
    width = max(1, *sizes)  # never an empty collective

    def unpad(out: torch.Tensor) -> torch.Tensor:
        blocks = out.reshape(len(sizes), width, *out.shape[1:])
        return torch.cat([blocks[t, :n] for t, n in enumerate(sizes)])

    def leg(x: torch.Tensor, async_op: bool):
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[:sizes[me]] = x
        h = comm.all_gather(padded, g.mesh, g.axis, async_op=True, tag=tag)
        return _Mapped(h, unpad) if async_op else unpad(h.wait())
    return leg


def _scatter(g: _Group, sizes: tuple[int, ...], me: int, tag: str) -> Leg:
    """Reduce-scatter rows laid out as :func:`_gather` returns them: tp rank t gets the
    sum of block t (``sizes[t]`` rows) over the peers."""
    width = max(1, *sizes)
    starts = [sum(sizes[:t]) for t in range(len(sizes))]

    def leg(x: torch.Tensor, async_op: bool):
        padded = x.new_zeros((len(sizes), width, *x.shape[1:]))
        for t, (s, n) in enumerate(zip(starts, sizes)):
            padded[t, :n] = x[s:s + n]
        h = comm.reduce_scatter(padded.reshape(len(sizes) * width, *x.shape[1:]), g.mesh, g.axis,
                                async_op=True, tag=tag)
        return _Mapped(h, lambda out: out[:sizes[me]]) if async_op else h.wait()[:sizes[me]]
    return leg


@dataclass(frozen=True)
class _Journey:
    """Per chunk: the legs in (to the expert), and the legs out (home)."""

    inbound: tuple[tuple[Leg, ...], ...]
    outbound: tuple[tuple[Leg, ...], ...]


def _journey(c: Chunks, ep: _Group, tp: _Group | None, tp_rank: int, tags: tuple[str, str, str, str]) -> _Journey:
    """``tags``: the in all-to-all, the tp gather, the tp scatter, the out all-to-all."""
    inbound, outbound = [], []
    for i in range(len(c.expert)):
        legs_in: list[Leg] = [_a2a(ep, c.send[i], c.recv[i], f"{tags[0]} {i}")]
        legs_out: list[Leg] = [_a2a(ep, c.recv[i], c.send[i], f"{tags[3]} {i}")]
        if tp is not None:
            legs_in.append(_gather(tp, c.tp_rows[i], tp_rank, f"{tags[1]} {i}"))
            legs_out.insert(0, _scatter(tp, c.tp_rows[i], tp_rank, f"{tags[2]} {i}"))
        inbound.append(tuple(legs_in))
        outbound.append(tuple(legs_out))
    return _Journey(tuple(inbound), tuple(outbound))


FORWARD_TAGS = ("moe pipe dispatch", "moe pipe gather", "moe pipe scatter", "moe pipe combine")
"""Comm-log tags of a chunk's legs (then its index), forward; backward each leg is its
transpose's tag + " backward" (the gradient's in all-to-all is the combine's)."""
BACKWARD_TAGS = ("moe pipe combine backward", "moe pipe scatter backward", "moe pipe gather backward",
                 "moe pipe dispatch backward")


# ------------------------------------------------------------------ engines

Compute = Callable[[int, torch.Tensor], torch.Tensor]


def _serial(inputs: list[torch.Tensor], j: _Journey, compute: Compute) -> list[torch.Tensor]:
    def move(x: torch.Tensor, leg: Leg) -> torch.Tensor:  # under ep_overlap: another microbatch computes meanwhile
        return lanes.hide(leg(x, True)) if lanes.active() else leg(x, False)

    out = []
    for i, x in enumerate(inputs):
        for leg in j.inbound[i]:
            x = move(x, leg)
        y = compute(i, x)
        for leg in j.outbound[i]:
            y = move(y, leg)
        out.append(y)
    return out


def _pipelined(inputs: list[torch.Tensor], j: _Journey, compute: Compute) -> list[torch.Tensor]:
    n = len(inputs)
    first = [j.inbound[i][0](inputs[i], True) for i in range(n)]  # every chunk's first leg, up front
    arriving: dict[int, Any] = {}
    leaving: dict[int, Any] = {}

    def advance(handle: Any, legs: tuple[Leg, ...]) -> Any:  # the remaining legs, the last left in flight
        for leg in legs:
            handle = leg(handle.wait(), True)
        return handle

    arriving[0] = advance(first[0], j.inbound[0][1:])
    for i in range(n):
        if i + 1 < n:  # the next chunk's later in-legs go out before this one computes
            arriving[i + 1] = advance(first[i + 1], j.inbound[i + 1][1:])
        # under ep_overlap another microbatch computes while the chunk is out (dtp.ops.lanes)
        leaving[i] = j.outbound[i][0](compute(i, lanes.hide(arriving.pop(i))), True)
        if i >= 1:
            leaving[i - 1] = advance(leaving[i - 1], j.outbound[i - 1][1:])
    leaving[n - 1] = advance(leaving[n - 1], j.outbound[n - 1][1:])
    return [lanes.hide(leaving[i]) for i in range(n)]


class Stream:
    """A communication stream: one daemon thread running what is submitted to it in
    submission order. Collectives it runs are recorded in the comm logs active where they
    were submitted; the time the submitter then blocks in ``wait()`` is charged to the
    last collective of the submission (``CommRecord.waited``: the exposed part).

    >>> s = Stream("doc")
    >>> s.submit(lambda a, b: a + b, 1, 2).wait()
    3
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"dtp stream {name}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> "_StreamHandle":
        handle = _StreamHandle()
        self._queue.put((handle, fn, args, comm.active_logs()))
        return handle

    def _loop(self) -> None:
        while True:
            handle, fn, args, logs = self._queue.get()
            try:
                with comm.record_into(logs):  # record where the submitter records
                    with comm.comm_log() as mine:
                        result = fn(*args)
                    handle.records = mine.records
                    handle.future.set_result(result)
            except BaseException as e:  # handed to the waiting thread, which raises it
                handle.future.set_exception(e)


class _StreamHandle:
    def __init__(self) -> None:
        self.future: Future = Future()
        self.records: list[comm.CommRecord] = []

    def wait(self) -> Any:
        entered = time.perf_counter()
        result = self.future.result()
        for rec in self.records:  # run synchronously on the stream: its wait is not the caller's
            rec.waited = 0.0
        if self.records:
            self.records[-1].waited = time.perf_counter() - entered
        return result


_streams: dict[str, Stream] = {}


def _stream(name: str) -> Stream:
    if name not in _streams:
        _streams[name] = Stream(name)
    return _streams[name]


def _on_stream(inputs: list[torch.Tensor], j: _Journey, compute: Compute) -> list[torch.Tensor]:
    """Chunk i's in-legs go to the stream before chunk i-1 computes, its out-legs right
    after it computes: the stream runs in0 in1 out0 in2 out1 … back to back."""
    s = _stream("moe")

    def run(x: torch.Tensor, legs: tuple[Leg, ...]) -> torch.Tensor:
        for leg in legs:
            x = leg(x, False)
        return x

    n = len(inputs)
    arriving = {0: s.submit(run, inputs[0], j.inbound[0])}
    leaving = []
    for i in range(n):
        if i + 1 < n:
            arriving[i + 1] = s.submit(run, inputs[i + 1], j.inbound[i + 1])
        leaving.append(s.submit(run, compute(i, arriving.pop(i).wait()), j.outbound[i]))
    return [h.wait() for h in leaving]


# ------------------------------------------------------------------ the autograd function


@dataclass(frozen=True)
class _Run:
    chunks: Chunks
    forward: _Journey
    backward: _Journey
    engine: Callable[[list[torch.Tensor], _Journey, Compute], list[torch.Tensor]]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


class _ExpertPath(torch.autograd.Function):
    """Rows sorted by expert → each chunk's journey and expert FFN → rows home; backward
    the same for the gradients (module docstring)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, run):  # type: ignore[override]
        c = run.chunks
        # Weight leaves per local expert: each chunk's graph ends at its expert's slices.
        leaves = [tuple(w.detach()[l].requires_grad_() for w in (w_gate, w_up, w_down))
                  for l in range(w_gate.shape[0])]
        graphs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def compute(i: int, xa: torch.Tensor) -> torch.Tensor:
            xa = xa.detach().requires_grad_()
            # The chunk's graph saves its tensors plainly: under activation recompute the
            # checkpoint's hooks would otherwise pack them too, and every chunk's backward
            # would recompute the whole block again (measured: 3× the block's forwards).
            # So under recompute the experts' activations stay from forward to backward.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                y = _ffn(xa, *leaves[c.expert[i]])
            graphs.append((xa, y))
            return y.detach()

        back = run.engine([x[rows] for rows in c.rows], run.forward, compute)
        out = x.new_zeros((x.shape[0], w_down.shape[-1]))  # rows other tp ranks carry stay 0
        for rows, y in zip(c.rows, back):
            out[rows] = y
        ctx.run, ctx.graphs, ctx.leaves = run, graphs, leaves
        ctx.shapes = (x.shape, w_gate.shape, w_up.shape, w_down.shape)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        run, c = ctx.run, ctx.run.chunks
        x_shape, *w_shapes = ctx.shapes
        grads_w = [grad.new_zeros(shape) for shape in w_shapes]

        def compute(i: int, g: torch.Tensor) -> torch.Tensor:
            xa, y = ctx.graphs[i]
            gx, *gw = torch.autograd.grad(y, (xa, *ctx.leaves[c.expert[i]]), g)
            for acc, part in zip(grads_w, gw):
                acc[c.expert[i]] += part
            return gx

        back = run.engine([grad[rows] for rows in c.rows], run.backward, compute)
        grad_x = grad.new_zeros(x_shape)
        for rows, g in zip(c.rows, back):
            grad_x[rows] = g
        ctx.graphs = ctx.leaves = None
        return grad_x, *grads_w, None


def expert_path(rows: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, w_gate: torch.Tensor,
                w_up: torch.Tensor, w_down: torch.Tensor, mesh: DeviceMesh, ep_axes: tuple[str, ...], *,
                tp_axis: str | None = None, pipe_experts: bool = False, multi_data: int = 1,
                multi_stream: bool = False) -> torch.Tensor:
    """The SwiGLU output of each row's expert for ``rows`` (N, d) routed to ``expert_ids``
    (global ids), computed on the rank that holds the expert (module docstring).

    - `mesh`: the whole mesh; `ep_axes`: the axes experts are split over (one, or several
      folded into their flattened view).
    - Weights are this rank's ``L`` experts, (L, d, f), (L, d, f), (L, f, d), with ``f``
      this rank's share when `tp_axis` splits each expert's width: then the tp ranks
      (which routed the same tokens) each send a 1/tp slice of the rows, gather their
      peers' at the expert, and the rows that come home hold this rank's slice, the
      others zero — a pending sum over ``tp_axis``, as a row-parallel layer's output.
    - `pipe_experts`, `multi_data`, `multi_stream`: the engine and the chunking.

    Differentiable; one counts exchange (and its host sync), then per chunk one
    all-to-all each way (and one tp all-gather and reduce-scatter), forward and backward.

    Raises: as :func:`dtp.ops.moe_dispatch.plan_dispatch` (every rank alike).
    """
    ep_mesh = flatten_axes(mesh, ep_axes)
    ep = _Group(ep_mesh, axis_names(ep_mesh)[0])
    p = moe_dispatch.plan_dispatch(rows, expert_ids, num_experts, ep.mesh, ep.axis, fn="moe expert path")
    tp_size = axis_size(mesh, tp_axis) if tp_axis is not None else 1
    tp_rank = mesh.get_local_rank(tp_axis) if tp_size > 1 else 0
    c = chunks(p, multi_data, tp_size, tp_rank)
    if multi_stream:  # the stream's own groups: the main thread keeps posting on the mesh's
        other = twin(mesh)
        ep = _Group(flatten_axes(other, ep_axes), ep.axis)
        mesh = other
    tp = _Group(mesh, tp_axis) if tp_size > 1 else None
    engine = _on_stream if multi_stream else _pipelined if pipe_experts else _serial
    run = _Run(c, _journey(c, ep, tp, tp_rank, FORWARD_TAGS), _journey(c, ep, tp, tp_rank, BACKWARD_TAGS), engine)
    return _ExpertPath.apply(rows[p.order], w_gate, w_up, w_down, run)[p.unorder]
