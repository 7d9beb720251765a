"""Pictures of a run: loss curves (PNG files, with or without matplotlib) and comm timelines.

matplotlib is an optional dependency (``pip install dtp[plot]``): ``dtp train`` must be
able to leave a picture of its loss curve on a bare machine too. The fallback is a tiny
PNG encoder (``zlib`` + ``struct``) that draws an axes box, a light grid and one polyline
per series — enough to see whether a run learns, not a plotting library.

:func:`plot_timeline` (matplotlib only) draws every rank's :func:`dtp.comm_log` as a
Gantt chart: compute spans and collectives on one clock.

Both draw on a ``matplotlib.figure.Figure`` of their own when given a path, never
through pyplot, so they leave pyplot's backend (a notebook's inline one) alone; given a
matplotlib ``Axes`` they draw on it.

>>> from dtp.plot import plot_loss
>>> plot_loss("loss.png", [4.1, 3.2, 2.9], title="tiny, dp=2", use_matplotlib=False)
'builtin'
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

if TYPE_CHECKING:
    from ..core.comm import CommLog

__all__ = ["plot_loss", "plot_timeline", "write_line_png", "png_size"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

Color = tuple[int, int, int]
# matplotlib's tab10 blue / orange / green / red: the same colours either way.
_PALETTE: tuple[Color, ...] = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
_AXES: Color = (64, 64, 64)
_GRID: Color = (225, 225, 225)
_WHITE: Color = (255, 255, 255)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it over ``path``.

    Readers (and a crash mid-write) never see half a file. The file is created with
    ``open`` rather than ``mkstemp``, so it gets the usual umask permissions, not 0600.

    >>> with atomic_path("out/notes.txt") as tmp:
    ...     n = tmp.write_text("step 1: 4.1")
    >>> Path("out/notes.txt").read_text()
    'step 1: 4.1'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()  # only still there when something failed


def _atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


# --------------------------------------------------------------------------- PNG encoder


def _chunk(kind: bytes, data: bytes) -> bytes:
    # length, type, data, CRC-32 over type + data (PNG spec, section 5.3)
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _encode_png(pixels: Sequence[bytearray], width: int, height: int) -> bytes:
    """8-bit RGB, no interlace; every scanline uses filter 0 ("None")."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # depth 8, colour type 2 = RGB
    return PNG_SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's IHDR chunk; ``ValueError`` if ``data`` is no PNG.

    >>> png_size(_encode_png([bytearray(3 * 2)], 2, 1))
    (2, 1)
    """
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file (bad signature or first chunk is not IHDR)")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.rows = [bytearray(_WHITE * width) for _ in range(height)]

    def dot(self, x: int, y: int, color: Color, thick: int = 1) -> None:
        for dy in range(thick):
            for dx in range(thick):
                px, py = x + dx - thick // 2, y + dy - thick // 2
                if 0 <= px < self.width and 0 <= py < self.height:
                    self.rows[py][3 * px : 3 * px + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, thick: int = 1) -> None:
        # Bresenham: integer-only, visits every pixel of the segment once.
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, color, thick)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy


def write_line_png(
    path: str | os.PathLike[str],
    series: Mapping[str, Sequence[float]] | Sequence[float],
    *,
    width: int = 640,
    height: int = 400,
) -> None:
    """Draw one polyline per series (x = index) inside an axes box; write an RGB PNG.

    No matplotlib needed. Non-finite values are skipped (the line breaks there). All
    series share one y range, so a run and its reference overlay directly.

    >>> write_line_png("loss.png", {"loss": [4.0, 3.1, 2.7, 2.5]})
    >>> png_size(Path("loss.png").read_bytes())
    (640, 400)
    """
    if width < 16 or height < 16:
        raise ValueError(f"write_line_png: image must be at least 16x16, got {width}x{height}")
    named = dict(series) if isinstance(series, Mapping) else {"loss": list(series)}
    canvas = _Canvas(width, height)
    left, right, top, bottom = 8, width - 9, 8, height - 9  # the axes box, inclusive
    finite = [float(v) for ys in named.values() for v in ys if math.isfinite(float(v))]
    n = max((len(ys) for ys in named.values()), default=0)

    for i in range(1, 4):  # a light 4x4 grid, so slopes can be read roughly
        gx = left + (right - left) * i // 4
        gy = top + (bottom - top) * i // 4
        canvas.line(gx, top, gx, bottom, _GRID)
        canvas.line(left, gy, right, gy, _GRID)

    if finite:
        lo, hi = min(finite), max(finite)
        pad = (hi - lo) * 0.05 or max(abs(hi) * 0.05, 1e-12)  # a flat line sits mid-box
        lo, hi = lo - pad, hi + pad

        def to_px(i: int, v: float) -> tuple[int, int]:
            x = left + (right - left) * (i / (n - 1) if n > 1 else 0.5)
            y = bottom - (bottom - top) * (v - lo) / (hi - lo)
            return round(x), round(y)

        for k, ys in enumerate(named.values()):
            color = _PALETTE[k % len(_PALETTE)]
            prev: tuple[int, int] | None = None
            for i, v in enumerate(ys):
                v = float(v)
                if not math.isfinite(v):
                    prev = None
                    continue
                cur = to_px(i, v)
                if prev is None:
                    canvas.dot(*cur, color, 2)
                else:
                    canvas.line(*prev, *cur, color, 2)
                prev = cur

    # The box last, on top of the grid and any line touching the edge.
    canvas.line(left, top, right, top, _AXES)
    canvas.line(left, bottom, right, bottom, _AXES)
    canvas.line(left, top, left, bottom, _AXES)
    canvas.line(right, top, right, bottom, _AXES)
    _atomic_write_bytes(path, _encode_png(canvas.rows, width, height))


# --------------------------------------------------------------------------- front end


def _matplotlib_figure() -> Any:
    """``matplotlib.figure.Figure``, or ``None`` when matplotlib is absent.

    A bare Figure renders with Agg when saved and touches no global state: no display
    needed (ranks on a cluster node, CI), and a notebook's pyplot backend stays as it is.
    """
    try:
        import matplotlib  # first: sys.modules["matplotlib"] = None (how tests hide it) fails here
        from matplotlib.figure import Figure
    except ImportError:
        return None
    del matplotlib
    return Figure


def _is_path(out: object) -> bool:
    return isinstance(out, (str, os.PathLike))


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")


def plot_loss(
    out: str | os.PathLike[str] | Any,
    losses: Sequence[float] | Mapping[str, Sequence[float]],
    *,
    steps: Sequence[int] | None = None,
    title: str = "",
    use_matplotlib: bool | None = None,
) -> str:
    """Draw loss against step into a PNG at ``out`` or on the matplotlib Axes ``out``;
    return the renderer used.

    ``losses`` is one curve or ``{label: curve}`` (e.g. the run and its single-process
    reference). ``use_matplotlib``: ``None`` uses it when importable, ``False`` forces the
    built-in writer, ``True`` requires matplotlib (an Axes does too). Returns
    ``"matplotlib"`` or ``"builtin"``.

    Raises: ``ImportError`` for ``use_matplotlib=True`` without matplotlib.

    >>> plot_loss("loss.png", {"dp=2": [4.1, 3.0], "reference": [4.1, 3.0]}, use_matplotlib=False)
    'builtin'
    """
    named = dict(losses) if isinstance(losses, Mapping) else {"loss": list(losses)}
    if not _is_path(out):
        _draw_loss(out, named, steps, title)
        return "matplotlib"
    figure = None if use_matplotlib is False else _matplotlib_figure()
    if figure is None:
        if use_matplotlib:
            raise ImportError("plot_loss(use_matplotlib=True) needs matplotlib: pip install 'dtp[plot]'")
        write_line_png(out, named)
        return "builtin"
    fig = figure(figsize=(6.4, 4.0), dpi=100)
    _draw_loss(fig.subplots(), named, steps, title)
    fig.tight_layout()
    _save(fig, out)
    return "matplotlib"


def _draw_loss(ax: Any, named: Mapping[str, Sequence[float]], steps: Sequence[int] | None, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    for k, (label, ys) in enumerate(named.items()):
        xs = list(steps) if steps is not None and len(steps) == len(ys) else list(range(1, len(ys) + 1))
        # Later curves dashed: a reference that matches the run must not hide it.
        ax.plot(xs, list(ys), label=label, linewidth=1.5, linestyle="-" if k == 0 else "--")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(named) > 1:
        ax.legend()


# --------------------------------------------------------------------------- comm timeline

# Compute spans in greys, collectives in colours: what overlaps what reads at a glance.
_SPAN_COLORS = {"forward": "#9ecae1", "backward": "#6baed6", "update": "#bdbdbd"}
_COMM_COLORS = ("#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def plot_timeline(logs: Sequence[CommLog], out: str | os.PathLike[str] | Any, *, title: str = "") -> Any:
    """Draw each rank's compute spans and collectives over time (a Gantt chart).

    ``logs[r]`` is rank ``r``'s :class:`~dtp.comm.CommLog` (e.g. ``run(fn, world_size=n)``
    returning each rank's ``comm_log()``). Each rank gets a row: its :class:`~dtp.comm.Span` s
    (``forward``, ``backward``, ``update`` …) as a wide bar, its collectives from issue to
    completion as a narrow one beneath, coloured by kind and mesh axis. Time is in ms from
    the earliest event of any rank. Writes a PNG when ``out`` is a path, draws on it when it
    is a matplotlib Axes; returns the Axes.

    Raises: ``ImportError`` without matplotlib (``pip install 'dtp[plot]'``).

    >>> from dtp.comm import CommLog, CommRecord, Span
    >>> grads = CommRecord("all_reduce", "dp", 64, 2, torch.float32, (16,), issued=0.004, completed=0.005)
    >>> log = CommLog([grads], [Span("forward", 0.0, 0.002), Span("backward", 0.002, 0.006)])
    >>> ax = plot_timeline([log, log], "timeline.png")
    >>> [t.get_text() for t in ax.get_yticklabels()], png_size(Path("timeline.png").read_bytes())
    (['rank 0', 'rank 1'], (640, 192))
    """
    figure = _matplotlib_figure()
    if figure is None:
        raise ImportError("plot_timeline needs matplotlib: pip install 'dtp[plot]'")
    ax = out
    if _is_path(out):
        fig = figure(figsize=(8.0, 1.5 + 0.45 * len(logs)), dpi=80)
        ax = fig.subplots()
    _draw_timeline(ax, logs, title)
    if _is_path(out):
        fig.tight_layout()
        _save(fig, out)
    return ax


def _draw_timeline(ax: Any, logs: Sequence[CommLog], title: str) -> None:
    from matplotlib.patches import Patch

    # Every rank's times are time.perf_counter(): on Linux that is CLOCK_MONOTONIC, one
    # clock for every process on the machine (time since boot), so the ranks of a local
    # pool or of one node share a time axis as they are. Ranks on different hosts do not
    # (each boot has its own zero); their rows would need aligning first.
    starts = [sp.start for log in logs for sp in log.spans] + [r.issued for log in logs for r in log.records]
    t0 = min(starts, default=0.0)
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    comm_colors: dict[str, str] = {}
    for rank, log in enumerate(logs):
        y = rank  # rank 0 on top: the y axis is inverted below
        for sp in log.spans:
            end = sp.end if sp.end is not None else sp.start
            ax.broken_barh([(ms(sp.start), ms(end) - ms(sp.start))], (y - 0.45, 0.45),
                           facecolors=_SPAN_COLORS.get(sp.name, "#d9d9d9"), edgecolor="white", linewidth=0.5)
        for r in log.records:
            key = f"{r.kind} {r.axis}"
            color = comm_colors.setdefault(key, _COMM_COLORS[len(comm_colors) % len(_COMM_COLORS)])
            end = r.completed if r.completed is not None else r.issued
            # A collective never shorter than a hairline, so instant ones still show.
            ax.broken_barh([(ms(r.issued), max(ms(end) - ms(r.issued), 0.02))], (y + 0.05, 0.3),
                           facecolors=color, alpha=0.8, linewidth=0)
    ax.set_yticks(range(len(logs)), [f"rank {r}" for r in range(len(logs))])
    ax.set_ylim(len(logs) - 0.4, -0.6)
    ax.set_xlabel("ms")
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    names = dict.fromkeys(sp.name for log in logs for sp in log.spans)
    handles = [Patch(color=_SPAN_COLORS.get(n, "#d9d9d9"), label=n) for n in names]
    handles += [Patch(color=c, label=k) for k, c in comm_colors.items()]
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
