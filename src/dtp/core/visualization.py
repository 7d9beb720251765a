"""``visualize``: which rank holds which block of a DTensor, for any number of dims."""

from __future__ import annotations

import html
import math

from torch.distributed.tensor import DTensor

from ._torch import is_local_tensor, local_tensor
from .mesh.devices import all_coordinates, axis_names, block_index
from .spec import P, spec_of

__all__ = ["visualize", "Visualization"]


def _ranges(size: int, axes: tuple[str, ...], coord: dict[str, int], sizes: dict[str, int], mesh) -> str:
    n = math.prod(sizes[a] for a in axes)
    if n == 1:
        return ":"
    idx = block_index(mesh, axes, coord)
    step = size // n
    return f"{idx * step}:{(idx + 1) * step}"


class Visualization:
    """Text table (terminal) that also renders as an HTML table in notebooks."""

    def __init__(self, title: str, header: list[str], rows: list[list[str]]):
        self.title, self.header, self.rows = title, header, rows

    def __str__(self) -> str:
        widths = [max(len(r[i]) for r in [self.header, *self.rows]) for i in range(len(self.header))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [self.title, fmt.format(*self.header), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r) for r in self.rows]
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.header)
        body = "".join("<tr>" + "".join(f"<td><code>{html.escape(c)}</code></td>" for c in r) + "</tr>" for r in self.rows)
        return f"<p><b>{html.escape(self.title)}</b></p><table><tr>{head}</tr>{body}</table>"


def visualize(x: DTensor) -> Visualization:
    """Show, for every rank, its mesh coordinate and the global index range it holds.

    Works for any number of dims; blocks are Python slices of the global tensor (a
    pending sum is marked ``+partial(axis)``).

    >>> with dtp.testing.simulate(2):
    ...     print(visualize(dtp.shard(torch.zeros(4, 6), make_mesh(dp=2), P("dp"))))
    P('dp') on mesh {'dp': 2}: global shape (4, 6), local per-rank
    rank  coordinate  block     note
    ----  ----------  --------  ----
    0     dp=0        [0:2, :]
    1     dp=1        [2:4, :]

    Every rank's block of a pending sum is one of its terms (a matmul's partial sums; here
    ``dtp.shard``'s, the value and zeros):

    >>> with dtp.testing.simulate(2):
    ...     print(visualize(dtp.shard(torch.ones(2, 2), make_mesh(tp=2), P(partial="tp"))).rows)
    [['0', 'tp=0', '[:, :]', '+partial(tp)'], ['1', 'tp=1', '[:, :]', '+partial(tp)']]
    """
    spec: P = spec_of(x)
    mesh = x.device_mesh
    names = axis_names(mesh)
    sizes = {n: mesh.size(i) for i, n in enumerate(names)}
    mesh_ranks = mesh.mesh.reshape(-1).tolist()
    rows = []
    for rank, coord in zip(mesh_ranks, all_coordinates(mesh)):
        block = ", ".join(_ranges(s, spec.axes_of(d), coord, sizes, mesh) for d, s in enumerate(x.shape))
        # Every rank's block is a term of the pending sum: dtp.shard puts the value on
        # coordinate 0 and zeros elsewhere, but a matmul's partial sums are all non-zero.
        note = " ".join(f"+partial({a})" for a in spec.partial)
        rows.append([str(rank), ", ".join(f"{n}={coord[n]}" for n in names), f"[{block}]", note])
    title = f"{spec} on mesh {dict(sizes)}: global shape {tuple(x.shape)}, local {tuple(local_tensor(x).shape) if not _is_local(x) else 'per-rank'}"
    return Visualization(title, ["rank", "coordinate", "block", "note"], rows)


def _is_local(x: DTensor) -> bool:
    return is_local_tensor(local_tensor(x))
