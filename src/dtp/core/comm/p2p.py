"""Point to point: :class:`Peer` (one coordinate of a mesh axis, its group resolved once)
and :func:`send` / :func:`recv` (one message each).

A pipeline stage posts 9-27 messages a step per rank at pp=2 (``benchmarks/pipeline.py``),
each through the same group to the same coordinate. :func:`send` / :func:`recv` look the
group up per message (``DeviceMesh.get_group``, the rank map, ``dist.isend``'s checks, the
compiler guard): measured on this 2-core machine (a one-off probe, 2 gloo ranks, 50
messages of 8 B or 512 KB, receiver posted ahead, 2026-11-26) 75-98 µs of the posting
thread's CPU per message and 105 Python calls a send and its wait, against 20-54 µs for a
bare ``dist.isend``/``irecv``. A :class:`Peer` made once per step does that look-up once
and posts on the group directly (38-66 µs, 42 calls); every message is still recorded
(:func:`dtp.comm.comm_log`, the flight record) and handled as any other.

>>> with dtp.testing.simulate(2):
...     mesh = make_mesh(pp=2)
...     Peer(mesh, "pp", 1).to
1
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..mesh.devices import mesh_device
from .collectives import _eager, _group, _nbytes, _on_mesh
from .flight import _failure, _record
from .handles import CommHandle
from .link import _link_applies, _link_board

__all__ = ["Peer", "send", "recv"]


class Peer:
    """Sends to and receives from coordinate ``to`` of ``axis`` (its rank in the axis'
    group). Holds the group: make one per step (a pipeline :class:`~dtp.strategies.pipeline.Run`
    does), not one per process, so a group destroyed and made again is never reused."""

    def __init__(self, mesh: DeviceMesh, axis: str, to: int):
        self.mesh, self.axis, self.to = mesh, axis, to
        self.group, self.n = _group(mesh, axis)
        self.device = mesh_device(mesh)
        # Whether CPU tensors travel as they are (gloo; a group with a CPU backend), asked once.
        self.host = mesh.device_type == "cpu" or _on_mesh(torch.empty(0), mesh, axis).device.type == "cpu"
        self.linked = _link_applies(axis)

    def _post(self, kind: str, x: torch.Tensor, sent: int, received: int, tag: str, key: int) -> CommHandle:
        if self.n == 1:  # nothing moves: no message, no record
            return CommHandle(None, None, lambda: x)
        record = _record(kind, self.axis, sent, self.n, x, True, tag)
        link = None
        if self.linked:  # noted on the board before posting: the receiver reads it once the data is in
            board, since = _link_board(), None
            if board is not None and kind == "send":
                board.send(self.group, self.to, key, sent, record.issued)
            elif board is not None:
                since = board.recv(self.group, self.to, key, received, record.issued)
            link = (self.axis, record.bytes, 1, since)
        try:
            # The group's own send/recv: ``to`` is already the group rank (dist.isend would
            # map it to a global rank and back, and check the tensor and group each time);
            # a complex tensor travels as its real view, as dist.isend / irecv send it.
            wire = torch.view_as_real(x) if x.is_complex() else x
            work = (self.group.send if kind == "send" else self.group.recv)([wire], self.to, key)
        except RuntimeError as e:  # a peer already gone: gloo can fail at posting
            raise _failure(record, e) from e
        return CommHandle(work, record, lambda: x, link, received, x.device.type)

    def send(self, x: torch.Tensor, *, key: int, tag: str = "") -> CommHandle:
        """Post ``x`` (see :func:`send`)."""
        x = x.contiguous()
        if not self.host and x.device.type == "cpu":
            x = x.to(self.device)
        return self._post("send", x, _nbytes(x), 0, tag, key)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, *, key: int, tag: str = "",
             device: torch.device | str | None = None) -> CommHandle:
        """Post a receive (see :func:`recv`)."""
        out = torch.empty(tuple(shape), dtype=dtype, device=self.device if device is None else device)
        return self._post("recv", out, 0, _nbytes(out), tag, key)


@_eager
def send(x: torch.Tensor, mesh: DeviceMesh, axis: str, *, to: int, key: int, tag: str = "") -> CommHandle:
    """Post ``x`` to coordinate ``to`` on ``axis`` (point to point, always asynchronous;
    wait on the handle before reusing ``x``). ``key`` (an int, as gloo's tag) pairs it with
    the :func:`recv` of the same key, so sends and receives between two ranks may be
    posted in any order. What a pipeline stage does with its activations and gradients."""
    return Peer(mesh, axis, to).send(x, key=key, tag=tag)


@_eager
def recv(shape: Sequence[int], dtype: torch.dtype, mesh: DeviceMesh, axis: str, *, frm: int, key: int,
         tag: str = "", device: torch.device | str | None = None) -> CommHandle:
    """Post a receive of a ``shape``/``dtype`` tensor from coordinate ``frm`` on ``axis``
    (asynchronous: ``wait()`` returns the tensor, on ``device``: by default the mesh's).
    Records 0 bytes: the sender counts them."""
    return Peer(mesh, axis, frm).recv(shape, dtype, key=key, tag=tag, device=device)
