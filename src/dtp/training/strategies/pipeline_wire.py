"""What travels between pipeline stages: a carry (a tensor, or a tree of them), its
headers, and the receive side (:class:`Incoming`).

A stage's output is a *carry*: one tensor (a dense model's hidden state) or a tree (an
MoE model's ``(h, per-block aux)``: the aux losses stay in the autograd graph, so their
gradients come back like the hidden state's). Each leaf travels as its own message; leaf
0 (the hidden state) may leave scattered over tp (:func:`scatter`). Microbatch 0's
message on a channel carries the headers: leaf 0's fixed header (shape, dtype,
placements, whether it requires a gradient, whether it came scattered) and, for a tree,
a second message with the tree's structure and every other leaf's header. Microbatches
of a step share all of it, so later receives are posted ahead from what microbatch 0
said. A dense model's carry sends exactly what it did before trees could travel.

>>> leaves, spec = flatten((torch.ones(2), {"a": torch.zeros(())}))
>>> len(leaves), spec.num_leaves
(2, 2)
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any, Sequence

import optree
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ...core import comm
from ...core._torch import local_shape
from ...core.mesh.devices import axis_names
from ...core.redistribute import reshard
from ...core.spec import P, spec_of

__all__ = ["HEADER", "Meta", "flatten", "header", "read_header", "tree_words", "read_tree_words", "sendable",
           "scatter", "Local", "Incoming", "share"]

PyTree = Any
HEADER = 24  # int64 words: ndim, 8 dims, dtype, one placement code per mesh dim (≤ 11), grad, tree words, gather
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32)
_GRAD, _TREE, _GATHER = HEADER - 3, HEADER - 2, HEADER - 1

_LEAF = optree.tree_structure(0)  # a carry that is one tensor

# One leaf as the receiver rebuilds it: (global shape, dtype, placements or None, came
# scattered, requires a gradient).
Meta = tuple[tuple[int, ...], torch.dtype, Any, bool, bool]


def _plain(tree: PyTree) -> PyTree:
    """Mappings of other kinds (MoE's lazy :class:`~dtp.ops.moe_stats.Aux`) as dicts, so
    their tensors are leaves (reading them waits for their statistics here)."""
    if isinstance(tree, Mapping) and not isinstance(tree, dict):
        return {k: _plain(tree[k]) for k in tree}
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_plain(v) for v in tree)
    return tree


def flatten(carry: PyTree) -> tuple[list[torch.Tensor], Any]:
    """A carry's tensors (the first one the hidden state) and its structure.

    Raises: ``TypeError`` for a leaf that is not a tensor.
    """
    if isinstance(carry, torch.Tensor):  # a dense model's carry: no tree to walk, every microbatch
        return [carry], _LEAF
    leaves, spec = optree.tree_flatten(_plain(carry))
    bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
    if bad or not leaves:
        raise TypeError(f"layouts.pipeline: what passes between stages must be a tensor or a tree of tensors, "
                        f"got leaves of type {bad or 'none'}")
    return leaves, spec


def header(x: torch.Tensor, gather: bool = False, tree_words: int = 0) -> torch.Tensor:
    """One leaf's fixed header (``tree_words``: the length of the tree message after it).

    >>> read_header(header(torch.ones(2, 3, dtype=torch.float64)), None)
    ((2, 3), torch.float64, None, False, False)
    """
    # Filled as a list, one tensor made at the end: item assignments into a tensor were
    # ~10 aten calls a header (benchmarks/pipeline_counts.py).
    h = [0] * HEADER
    h[0] = x.dim()
    h[1:1 + x.dim()] = list(x.shape)
    h[9] = _DTYPES.index(x.dtype)
    h[_GRAD], h[_TREE], h[_GATHER] = int(x.requires_grad), tree_words, int(gather)
    if isinstance(x, DTensor):
        for d, pl in enumerate(x.placements):
            if not isinstance(pl, (Replicate, Shard)):  # a pending sum has no code: sendable() reduces it first
                raise ValueError(f"layouts.pipeline: a tensor leaving its stage has placement {pl} on mesh dim {d} "
                                 f"({x.placements}); only Replicate and Shard travel (reduce it with sendable)")
            h[10 + d] = 1 if isinstance(pl, Replicate) else 2 + pl.dim  # Shard(dim)
    else:
        h[10] = -1  # a plain tensor
    return torch.tensor(h, dtype=torch.int64)


def read_header(h: torch.Tensor, mesh: DeviceMesh | None) -> Meta:
    """The leaf a header describes, placed on ``mesh`` (the receiver's stage mesh):
    ``(shape, dtype, placements, came scattered, requires a gradient)``.

    >>> read_header(header(torch.zeros(4, requires_grad=True)), None)[4]
    True
    """
    h = h.tolist()  # one read, not an item read per word
    n = h[0]
    shape = tuple(h[1:1 + n])
    dtype = _DTYPES[h[9]]
    placements = None
    if h[10] != -1 and mesh is not None:
        placements = tuple(Replicate() if c == 1 else Shard(c - 2) for c in h[10:10 + mesh.ndim])
    return shape, dtype, placements, bool(h[_GATHER]), bool(h[_GRAD])


def _pack(blob: bytes) -> torch.Tensor:
    """Bytes as int64 words, eight a word (a sum with zeros keeps any bit pattern)."""
    padded = blob + bytes(-len(blob) % 8)
    return torch.frombuffer(bytearray(padded), dtype=torch.int64).clone() if padded else \
        torch.zeros(0, dtype=torch.int64)


def _unpack(words: torch.Tensor, size: int) -> bytes:
    return words.contiguous().cpu().numpy().tobytes()[:size]


def tree_words(spec: Any, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tree message: leaf count, the structure (pickled), every leaf's header but the first.

    >>> leaves, spec = flatten((torch.ones(2), {"aux": torch.zeros((), dtype=torch.float64)}))
    >>> structure, metas = read_tree_words(tree_words(spec, leaves), None)
    >>> structure == spec, metas[0][:2]
    (True, ((), torch.float64))
    """
    blob = pickle.dumps(spec)
    heads = [header(x) for x in leaves[1:]]
    return torch.cat([torch.tensor([len(leaves), len(blob)], dtype=torch.int64), *heads, _pack(blob)])


def read_tree_words(words: torch.Tensor, mesh: DeviceMesh | None) -> tuple[Any, list[Meta]]:
    """The structure and the headers of leaves 1… from :func:`tree_words`' message."""
    n, size = int(words[0]), int(words[1])
    metas = [read_header(words[2 + k * HEADER:2 + (k + 1) * HEADER], mesh) for k in range(n - 1)]
    blob = _unpack(words[2 + (n - 1) * HEADER:], size)
    return pickle.loads(blob), metas


def contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    """A contiguous tensor's strides.

    >>> contiguous((2, 3, 4))
    (12, 4, 1)
    """
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def local_size(shape: Sequence[int], mesh: DeviceMesh | None, placements: Any) -> tuple[int, ...]:
    """The local shape of a leaf of global ``shape`` (itself for a plain tensor).

    >>> local_size((4, 2), None, None)
    (4, 2)
    """
    if placements is None or mesh is None:
        return tuple(shape)
    return local_shape(tuple(shape), mesh, placements)


def rebuild(body: torch.Tensor, meta: Meta, mesh: DeviceMesh | None) -> torch.Tensor:
    """A received leaf as the tensor it was (a DTensor on ``mesh`` when it was one).

    >>> rebuild(torch.ones(2), ((2,), torch.float32, None, False, False), None).tolist()
    [1.0, 1.0]
    """
    shape, _, placements, _, _ = meta
    if placements is None:
        return body
    return DTensor.from_local(body, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=contiguous(shape))


def sendable(x: torch.Tensor) -> torch.Tensor:
    """Pending sums are reduced before a tensor leaves its stage.

    >>> sendable(torch.ones(1)).tolist()
    [1.0]
    """
    if isinstance(x, DTensor) and any(isinstance(pl, Partial) for pl in x.placements):
        x = reshard(x, P(*spec_of(x).dims), tag="pp send reduce")
    return x


def scatter(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Megatron's scatter/gather optimisation: an activation replicated over a mesh axis
    (tp without sequence parallel) leaves its stage split over that axis along its last
    dim — each rank sends 1/t, the receiver all-gathers. A local slice here (no
    collective); in the graph, so the gradient comes back the same way.

    >>> scatter(torch.ones(2))[1]
    False
    """
    if not isinstance(x, DTensor) or x.dim() == 0:
        return x, False
    spec, mesh = spec_of(x), x.device_mesh
    last = x.dim() - 1
    if spec.partial or spec.axes_of(last):
        return x, False
    names = axis_names(mesh)
    for a, pl in zip(names, x.placements):
        n = mesh.size(names.index(a))
        if isinstance(pl, Replicate) and n > 1 and x.shape[last] % n == 0:
            dims = [spec.axes_of(d) for d in range(last)] + [(a,)]
            return reshard(x, P(*dims), tag="pp scatter"), True
    return x, False


class Local:
    """A hand-over between two stages of this rank (interleaved with pp=1 neighbours)."""

    def __init__(self, leaves: list[torch.Tensor], spec: Any, gather: bool):
        self.leaves, self.spec, self.gather = leaves, spec, gather

    def wait(self) -> tuple[list[torch.Tensor], Any, list[bool], list[bool]]:
        flags = [x.requires_grad for x in self.leaves]
        return [x.detach() for x in self.leaves], self.spec, [self.gather] + [False] * (len(self.leaves) - 1), flags


class Incoming:
    """A carry on its way. Microbatch 0's headers are read when it is taken; every later
    microbatch's body receives are posted as soon as they are known — ahead of the
    action that needs them, so the sender's transfer is answered while this rank
    computes. Measured on gloo (benchmarks/pipeline.py, 2 ranks): a body whose receive
    is posted only when needed waits 0.3-2.3 ms for the busy sender, posted ahead 0.01
    ms; and gloo's send/recv works report completion only once waited for, so no
    polling can find a header that came in early.

    ``channels``: the run's ``(kind, stage) -> (structure, metas)``; ``peer`` the sending
    stage's rank (:class:`dtp.comm.Peer`); ``keys(part)`` the
    message key of part 0 (leaf 0's header), 1 (its body), 2 (the tree), 2+j (leaf j)."""

    def __init__(self, channels: dict, channel: tuple[str, int], head: comm.CommHandle | None, peer: comm.Peer,
                 keys: Any, tag: str, smesh: DeviceMesh | None):
        self.channels, self.channel, self.head, self.peer, self.keys, self.tag = channels, channel, head, peer, keys, tag
        self.smesh = smesh
        self.bodies: list[comm.CommHandle] | None = None
        self.post_bodies()

    def post_bodies(self) -> None:
        """Post the bodies' receives once the channel's headers are known (idempotent)."""
        known = self.channels.get(self.channel)
        if self.bodies is None and known is not None:
            _, metas = known
            self.bodies = [self.peer.recv(local_size(shape, self.smesh, placements), dtype,
                                          key=self.keys(1 if j == 0 else 2 + j), tag=self.tag + (f" leaf {j}" if j else ""))
                           for j, (shape, dtype, placements, _, _) in enumerate(metas)]

    def wait(self) -> tuple[list[torch.Tensor], Any, list[bool], list[bool]]:
        """``(leaves, structure, came scattered, requires a gradient)``, one flag per leaf."""
        if self.head is not None:
            head = self.head.wait()
            first, words = read_header(head, self.smesh), int(head[_TREE])
            spec, rest = _LEAF, []
            if words:
                tree = self.peer.recv((words,), torch.int64, key=self.keys(2), tag=self.tag + " tree").wait()
                spec, rest = read_tree_words(tree, self.smesh)
            self.channels[self.channel] = (spec, [first, *rest])
        self.post_bodies()
        spec, metas = self.channels[self.channel]
        leaves = [rebuild(h.wait(), meta, self.smesh) for h, meta in zip(self.bodies, metas)]
        return leaves, spec, [m[3] for m in metas], [m[4] for m in metas]


def share(tree: PyTree, holder: bool, mesh: DeviceMesh, axis: str) -> PyTree:
    """The holder's ``tree`` (plain tensors and picklable values) on every rank of
    ``axis``: two all-reduces (its structure, then every tensor as float64 — exact for
    counts below 2⁵³ and for float32/64; a few hundred bytes for the structure) plus one
    for the structure's length. Every rank
    of ``axis`` calls it; exactly one is the holder.

    >>> share({"a": torch.ones(1)}, True, None, "pp")["a"].tolist()
    [1.0]
    """
    if mesh is None:
        return tree
    leaves, spec = optree.tree_flatten(_plain(tree)) if holder else ([], None)
    tensors = [x.full_tensor() if isinstance(x, DTensor) else x for x in leaves if isinstance(x, torch.Tensor)]
    shapes = [("tensor", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x) for x in leaves]
    blob = pickle.dumps((spec, shapes)) if holder else b""
    size = int(comm.all_reduce(torch.tensor([len(blob)], dtype=torch.int64), mesh, axis, tag="pp aux size")[0])
    words = _pack(blob) if holder else torch.zeros(-(-size // 8), dtype=torch.int64)
    spec, shapes = pickle.loads(_unpack(comm.all_reduce(words, mesh, axis, tag="pp aux tree"), size))
    sizes = [torch.Size(s[1]).numel() for s in shapes if s[0] == "tensor"]
    flat = torch.cat([x.detach().reshape(-1).to(torch.float64).cpu() for x in tensors]) if holder and tensors else \
        torch.zeros(sum(sizes), dtype=torch.float64)
    flat = comm.all_reduce(flat, mesh, axis, tag="pp aux") if sizes else flat
    out, parts = [], iter(flat.split(sizes)) if sizes else iter(())
    for s in shapes:
        out.append(next(parts).reshape(s[1]).to(s[2]) if s[0] == "tensor" else s[1])
    return optree.tree_unflatten(spec, out)
