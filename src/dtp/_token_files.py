"""Token files read without torch: the formats :func:`dtp.data.load_tokens` accepts, and
the two numbers ``dtp train`` checks before torch is imported (how many tokens, the
largest id: the corpus must fill a batch, the vocabulary must hold every id).

>>> count, largest = token_stats(None)      # the bundled corpus: bytes
>>> count > 300_000, largest < 256
(True, True)
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["read_ids", "token_stats", "held_out_start", "HELD_OUT_FRACTION"]

# The held-out split (``dtp train --eval-every``): the corpus's last tenth. The end of the
# file, not a random sample: windows that straddle the cut would leak training text.
HELD_OUT_FRACTION = 0.1


def read_ids(path: str | os.PathLike[str] | None) -> bytes | Any:
    """The token ids of a file: ``bytes`` (byte tokens) or a 1-D numpy integer array.

    Formats and errors: :func:`dtp.data.load_tokens`, which turns the result into a tensor.
    """
    if path is None:
        return (resources.files("dtp") / "assets" / "corpus.txt").read_bytes()
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".npy":
        import numpy as np  # lazily: only these two formats need it

        # allow_pickle=False: a token file must never be able to run code.
        array = np.load(path, allow_pickle=False)
        if array.ndim != 1:
            raise ValueError(f"{path}: expected a 1-D array of token ids, got shape {array.shape}")
        if array.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected an integer dtype for token ids, got {array.dtype}")
        if array.size and int(array.min()) < 0:
            raise ValueError(f"{path}: token ids must be non-negative, got {int(array.min())}")
        ids: Any = array
    elif suffix == ".bin":
        import numpy as np

        nbytes = path.stat().st_size
        if nbytes % 2:
            raise ValueError(f"{path}: a .bin token file holds uint16 ids, but its size ({nbytes} bytes) is odd")
        ids = np.fromfile(path, dtype="<u2")  # explicit little-endian, as nanoGPT writes it on x86/ARM hosts
    else:
        ids = path.read_bytes()
    if len(ids) == 0:
        raise ValueError(f"{path}: the file holds no tokens")
    return ids


def token_stats(path: str | os.PathLike[str] | None) -> tuple[int, int]:
    """``(number of tokens, largest id)`` of a token file (:func:`read_ids`)."""
    ids = read_ids(path)
    return len(ids), int(max(ids) if isinstance(ids, bytes) else ids.max())


def held_out_start(n_tokens: int) -> int:
    """Where the held-out split starts: tokens ``[0, cut)`` train, ``[cut, n)`` evaluate.

    >>> held_out_start(1000)
    900
    """
    return n_tokens - int(n_tokens * HELD_OUT_FRACTION)
