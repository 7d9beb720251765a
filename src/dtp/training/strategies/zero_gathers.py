"""ZeRO's parameter all-gathers left on the wire between steps (:mod:`dtp.strategies.zero`).

Stage 1/2 gather every bucket into the buffers the next forward reads; stage 3 gathers
the next forward's first ``prefetch`` + 1 buckets during the update and holds them whole
until that forward takes them (``overlap_param_gather``). Those held buckets are memory
at rest (llama "small" at ``bucket_mb=3``, dp=2: 2 buckets, 6.25 MiB per rank beside
18.76 MiB of master slices and moments), so they are named here, where :func:`dtp.plan`
(``held_gathers``) and the benchmarks can count them, not only where a profile finds them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...core import comm

__all__ = ["InflightGathers"]


class InflightGathers:
    """Parameter all-gathers still on the wire between steps, one slot per bucket.

    Mutable by name and by design: waiting clears a slot (stage 1/2: the result is in the
    state's buffers), or with ``hold`` (stage 3: the result is the gathered bucket, which
    the next step :meth:`take` s) keeps the waited handle. A :class:`ZeroState` holds one
    so the state itself stays plain data; waiting twice is harmless. ``buffers`` (stage 3):
    each slot's gather destination, so that :meth:`held` can say what the slots keep."""

    def __init__(self, handles: Sequence[comm.CommHandle | None] = (), *, hold: bool = False,
                 buffers: Sequence[torch.Tensor | None] = ()):
        self._handles, self._keep = list(handles), hold
        self._buffers = list(buffers) + [None] * (len(self._handles) - len(buffers))

    def wait(self, bucket: int | None = None) -> None:
        """Wait for bucket ``bucket``'s gather (all of them with ``None``); no new collective."""
        for b in range(len(self._handles)) if bucket is None else (bucket,):
            if b < len(self._handles) and self._handles[b] is not None:
                self._handles[b].wait()
                if not self._keep:
                    self._handles[b] = None

    def take(self, bucket: int) -> comm.CommHandle | None:
        """Stage 3: bucket ``bucket``'s gather the step before posted (``None``: none),
        handed over once, so that the state no longer holds the whole bucket."""
        handle = self._handles[bucket] if bucket < len(self._handles) else None
        if handle is not None:
            self._handles[bucket] = None
            self._buffers[bucket] = None
        return handle

    def held(self) -> list[torch.Tensor]:
        """The whole buckets the slots not yet taken keep alive (stage 3; stage 1/2's
        buffers are the state's own). Reading them does not wait: they may still be filling."""
        return [buf for h, buf in zip(self._handles, self._buffers) if h is not None and buf is not None]

    def done(self) -> bool:
        """True once nothing is left in flight (every slot waited for or taken)."""
        return all(h is None or h.is_completed() for h in self._handles)
