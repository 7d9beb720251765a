"""Loss curves as PNG files, with matplotlib when it is installed and without it otherwise.

matplotlib is an optional dependency (``pip install dtp[plot]``): ``dtp train`` must be
able to leave a picture of its loss curve on a bare machine too. The fallback is a tiny
PNG encoder (``zlib`` + ``struct``) that draws an axes box, a light grid and one polyline
per series — enough to see whether a run learns, not a plotting library.

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
from typing import Iterator, Mapping, Sequence

__all__ = ["plot_loss", "write_line_png", "png_size"]

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


def _matplotlib_pyplot():
    """pyplot on the non-interactive Agg backend, or ``None`` when matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:  # also when sys.modules["matplotlib"] is None (how tests force it)
        return None
    # Agg: no display needed (ranks on a cluster node, CI); set before pyplot is imported.
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_loss(
    path: str | os.PathLike[str],
    losses: Sequence[float] | Mapping[str, Sequence[float]],
    *,
    steps: Sequence[int] | None = None,
    title: str = "",
    use_matplotlib: bool | None = None,
) -> str:
    """Write a loss-vs-step PNG to ``path``; return the renderer used.

    ``losses`` is one curve or ``{label: curve}`` (e.g. the run and its single-process
    reference). ``use_matplotlib``: ``None`` uses it when importable, ``False`` forces the
    built-in writer, ``True`` requires matplotlib. Returns ``"matplotlib"`` or
    ``"builtin"``.

    >>> plot_loss("loss.png", {"dp=2": [4.1, 3.0], "reference": [4.1, 3.0]}, use_matplotlib=False)
    'builtin'
    """
    named = dict(losses) if isinstance(losses, Mapping) else {"loss": list(losses)}
    plt = None if use_matplotlib is False else _matplotlib_pyplot()
    if plt is None:
        if use_matplotlib:
            raise ImportError("plot_loss(use_matplotlib=True) needs matplotlib: pip install 'dtp[plot]'")
        write_line_png(path, named)
        return "builtin"

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    try:
        for k, (label, ys) in enumerate(named.items()):
            xs = list(steps) if steps is not None and len(steps) == len(ys) else list(range(1, len(ys) + 1))
            # Later curves dashed: a reference that matches the run must not hide it.
            ax.plot(xs, list(ys), label=label, linewidth=1.5, linestyle="-" if k == 0 else "--")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        if title:
            ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if len(named) > 1:
            ax.legend()
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return "matplotlib"
