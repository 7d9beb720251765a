"""Training data: a byte-level tokenizer, token files (memory-mapped: :func:`open_tokens`) and
a resumable batch loader.

Everything here is rank-independent on purpose: every rank that builds a
:class:`TokenLoader` with the same arguments produces the same *global* batch,
and the library shards that batch across the mesh afterwards. That keeps data
order identical no matter how the model is parallelised, so runs with
different layouts can be compared step for step.

Example::

    >>> from dtp.data import TokenLoader, load_tokens
    >>> loader = TokenLoader(load_tokens(), batch_size=4, seq_len=64, seed=0)
    >>> batch = loader.next_batch()
    >>> batch["tokens"].shape, batch["targets"].shape
    (torch.Size([4, 64]), torch.Size([4, 64]))
"""

from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import numpy as np
import torch

from .token_files import Tokens, document_eos, open_tokens
from ..ops.documents import pack_documents

__all__ = ["ByteTokenizer", "load_tokens", "open_tokens", "Tokens", "TokenLoader", "document_eos"]


def _bytes_to_tokens(data: bytes) -> torch.Tensor:
    # torch.frombuffer rejects empty buffers and warns on read-only ones,
    # hence the special case and the bytearray copy.
    if not data:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class ByteTokenizer:
    """Byte-level tokenizer: each UTF-8 byte is one token, so ``vocab_size == 256``.

    No training, no vocabulary file, and any text round-trips exactly.

    Example::

        >>> tok = ByteTokenizer()
        >>> ids = tok.encode("héllo")
        >>> ids.tolist()
        [104, 195, 169, 108, 108, 111]
        >>> tok.decode(ids)
        'héllo'
    """

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """Return the UTF-8 bytes of ``text`` as a 1-D int64 tensor.

        Example::

            >>> ByteTokenizer().encode("hi").tolist()
            [104, 105]
        """
        return _bytes_to_tokens(text.encode("utf-8"))

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Turn token ids back into text; invalid UTF-8 becomes U+FFFD.

        ``errors="replace"`` because a model's sampled bytes need not form
        valid UTF-8, and decoding them should never crash a generation loop.

        Example::

            >>> ByteTokenizer().decode([104, 105])
            'hi'
        """
        values = torch.as_tensor(ids).reshape(-1).tolist()
        bad = [v for v in values if not 0 <= v < self.vocab_size]
        if bad:
            raise ValueError(
                f"byte token ids must be in [0, {self.vocab_size}), got {bad[:5]}"
            )
        return bytes(values).decode("utf-8", errors="replace")


def load_tokens(path: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """Load a whole token file into a 1-D int64 tensor (small corpora; for large ones
    :func:`open_tokens` maps the file and :class:`TokenLoader` reads only its windows).

    * ``None``: the bundled corpus (Bierce's *The Devil's Dictionary*, about
      383 KB, see ``dtp/data/assets/SOURCE.md``) as byte tokens.
    * ``*.npy``: a 1-D integer array of token ids.
    * ``*.bin``: raw little-endian uint16 token ids (the nanoGPT convention; a sidecar
      may say uint32, :mod:`dtp.data.token_files`).
    * a directory of ``.bin`` or ``.npy`` shards, read in name order as one stream.
    * anything else: read as bytes and byte-tokenized like :class:`ByteTokenizer`.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for an
    empty file, an array of the wrong shape or dtype, or a negative id.

    Example::

        >>> tokens = load_tokens()          # bundled corpus
        >>> tokens.dtype, tokens.ndim
        (torch.int64, 1)
    """
    source = open_tokens(path)
    ids = torch.from_numpy(source.read(0, len(source)))
    if int(ids.min()) < 0:
        raise ValueError(f"{path}: token ids must be non-negative, got {int(ids.min())}")
    return ids


class TokenLoader:
    """Deterministic, resumable batches of language-model training windows.

    The corpus is cut into windows of ``seq_len + 1`` tokens whose starts are
    ``seq_len`` apart, so the inputs of consecutive windows tile the corpus
    without overlap (only the last target of one window is the first input of
    the next). Epoch ``e`` visits the windows in the order of a
    ``torch.randperm`` seeded with ``seed + e``; each batch takes the next
    ``batch_size`` windows, and the windows left over at the end of an epoch
    (fewer than a batch) are skipped so every batch is full.

    There is nothing rank-dependent inside: all ranks get the same global
    batch. The whole position is one integer, the number of batches served,
    so :meth:`state_dict` is tiny and resuming is exact.

    ``tokens`` is a 1-D integer tensor, or :class:`Tokens` (:func:`open_tokens`: a
    memory-mapped file or shard directory), from which each batch reads only its
    ``batch_size`` windows.

    Example::

        >>> loader = TokenLoader(torch.arange(100), batch_size=2, seq_len=8, seed=0)
        >>> b = loader.next_batch()
        >>> bool((b["tokens"][:, 1:] == b["targets"][:, :-1]).all())
        True
        >>> state = loader.state_dict()
        >>> again = TokenLoader(torch.arange(100), batch_size=2, seq_len=8, seed=0)
        >>> again.load_state_dict(state)
        >>> torch.equal(again.next_batch()["tokens"], loader.next_batch()["tokens"])
        True
    """

    def __init__(
        self, tokens: torch.Tensor | Tokens, *, batch_size: int, seq_len: int, seed: int = 0,
        documents: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if isinstance(tokens, Tokens):
            # Memory-mapped (or in memory): each batch reads its own windows, nothing more.
            self._source: Tokens | None = tokens
            n = len(tokens)
        else:
            tokens = torch.as_tensor(tokens)
            if tokens.ndim != 1:
                raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
            if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
                raise ValueError(f"tokens must have an integer dtype, got {tokens.dtype}")
            self._source = None
            self.tokens = tokens.to(torch.int64).contiguous()
            n = tokens.numel()

        window = seq_len + 1
        if n < window:
            raise ValueError(
                f"corpus has {n} tokens, shorter than one window of "
                f"seq_len + 1 = {window} tokens"
            )
        num_windows = (n - 1) // seq_len
        if num_windows < batch_size:
            raise ValueError(
                f"corpus of {n} tokens gives only {num_windows} windows of "
                f"seq_len + 1 = {window} tokens, fewer than batch_size = {batch_size}"
            )

        self.num_tokens = n
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = num_windows
        self._step = 0  # batches served so far; the loader's entire position
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)
        self._offsets = torch.arange(window)
        self.documents = documents  # the EOS id: batches carry packed documents (ops.documents)

    @property
    def batches_per_epoch(self) -> int:
        """Full batches per epoch (``num_windows // batch_size``)."""
        return self.num_windows // self.batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._step // self.batches_per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        # Cache one epoch's permutation; a private Generator keeps the global
        # RNG untouched, so model init or dropout cannot shift the data order.
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self) -> dict[str, torch.Tensor]:
        """Return the next global batch and advance.

        ``tokens`` and ``targets`` are ``LongTensor[batch_size, seq_len]``,
        with ``targets[:, i] == tokens[:, i + 1]`` for ``i < seq_len - 1``.

        Example::

            >>> loader = TokenLoader(torch.arange(50), batch_size=2, seq_len=4)
            >>> loader.next_batch()["tokens"].shape
            torch.Size([2, 4])
        """
        epoch, index = divmod(self._step, self.batches_per_epoch)
        perm = self._permutation(epoch)
        picked = perm[index * self.batch_size : (index + 1) * self.batch_size]
        if self._source is None:
            windows = self.tokens[picked[:, None] * self.seq_len + self._offsets]
        else:
            starts = (picked * self.seq_len).tolist()
            windows = torch.from_numpy(np.stack([self._source.read(a, a + self.seq_len + 1) for a in starts]))
        self._step += 1
        batch = {"tokens": windows[:, :-1].contiguous(), "targets": windows[:, 1:].contiguous()}
        return batch if self.documents is None else pack_documents(batch, self.documents)

    def state_dict(self) -> dict[str, Any]:
        """The loader's position plus the settings it is only valid for (plain ints).

        Example::

            >>> TokenLoader(torch.arange(50), batch_size=2, seq_len=4).state_dict()["step"]
            0
        """
        return {
            "step": self._step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": self.num_tokens,
            "fingerprint": self.fingerprint,
        }

    @functools.cached_property
    def fingerprint(self) -> str:
        """:meth:`Tokens.fingerprint` of the tokens this loader serves (read once, when
        first asked): a position means nothing in other tokens of the same count."""
        return (self._source if self._source is not None else Tokens([self.tokens.cpu().numpy()])).fingerprint()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next batch is the one that followed it.

        Raises ``ValueError`` if the state was saved by a loader with a
        different seed, batch size, sequence length, corpus length or corpus
        (:attr:`fingerprint`), since
        resuming it would silently yield a different data order.

        Example::

            >>> a = TokenLoader(torch.arange(50), batch_size=2, seq_len=4)
            >>> _ = a.next_batch()
            >>> b = TokenLoader(torch.arange(50), batch_size=2, seq_len=4)
            >>> b.load_state_dict(a.state_dict())
            >>> b.state_dict()["step"]
            1
        """
        mine = self.state_dict()
        mismatched = {
            k: (state[k], mine[k])
            for k in ("seed", "batch_size", "seq_len", "num_tokens", "fingerprint")
            if k in state and state[k] != mine[k]  # a state from before a key: unchecked
        }
        if mismatched:
            details = ", ".join(f"{k}: saved {s}, loader has {m}" for k, (s, m) in mismatched.items())
            raise ValueError(f"TokenLoader state does not match this loader ({details})")
        step = int(state["step"])
        if step < 0:
            raise ValueError(f"TokenLoader state has a negative step: {step}")
        self._step = step
