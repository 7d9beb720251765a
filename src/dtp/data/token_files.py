"""Token files read without torch, memory-mapped: what ``--data`` accepts, and the two
numbers ``dtp train`` checks before torch is imported (how many tokens, the largest id: the
corpus must fill a batch, the vocabulary must hold every id).

``--data`` is one of:

* nothing: the bundled corpus, byte tokens (in memory: 383 KB);
* a ``.bin`` file: raw little-endian ids, ``uint16`` (nanoGPT's) unless a sidecar or
  ``--data-dtype`` says ``uint32``;
* a ``.npy`` file: a 1-D integer array (its header read by ``np.load(mmap_mode="r")``);
* a directory of ``.bin`` or ``.npy`` shards: read as one stream, shards in name order;
* any other file: text, byte tokens, or ``--tokenizer``'s (Hugging Face ``tokenizers``);
  with ``--document-mask`` its lines are documents (a byte text's end at its newlines, a
  tokenized text's lines, ended by ``\\n`` or ``\\r\\n``, are encoded one by one, each followed
  by the tokenizer's EOS, which no line may hold).

The sidecar is a small JSON object beside a file (``train.bin.json``) or in a shard
directory (``tokens.json``): ``{"dtype": "uint32", "eos_id": 2, "vocab_size": 32000}``, every
key optional. A flag that disagrees with it is an error.

Token files are memory-mapped (read-only, advised for random access) and nothing here
reads one whole. :meth:`Tokens.read` is the one place ids are read;
:func:`token_stats` reads a bounded sample (:data:`SAMPLE_TOKENS`, see :meth:`Tokens.sample_range`).

>>> count, largest, _, _ = token_stats(None)      # the bundled corpus: bytes
>>> count > 300_000, largest < 256
(True, True)
"""

from __future__ import annotations

import bisect
import errno
import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

__all__ = ["Tokens", "open_tokens", "document_eos", "tokenizer_eos", "EOS_TOKENS", "TOKENIZER_CONFIGS",
           "token_stats", "TokenStats", "held_out_start", "HELD_OUT_FRACTION", "training_split", "DTYPES", "SIDECAR",
           "SAMPLE_TOKENS", "sidecar_path", "past_vocab"]

# The held-out split (``dtp train --eval-every``): the corpus's last tenth. The end of the
# file, not a random sample: windows that straddle the cut would leak training text.
HELD_OUT_FRACTION = 0.1
DTYPES = ("uint16", "uint32")  # what a .bin file may hold (--data-dtype)
SIDECAR = "tokens.json"  # in a shard directory; beside one file: "<file name>.json"
_SIDECAR_KEYS = ("dtype", "eos_id", "vocab_size")
_SUFFIXES = (".bin", ".npy")
# token_stats' bounded read when nothing states the vocabulary: the whole of a small corpus,
# else SAMPLE_CHUNKS evenly spaced runs adding up to this many ids (2-4 MiB at most).
SAMPLE_TOKENS = 1 << 20
SAMPLE_CHUNKS = 64
# Tokens.fingerprint's read: this many evenly spaced runs of FINGERPRINT_RUN ids (16 KiB
# of a memory-mapped file, whatever its size: a --resume checks it before any rank starts).
FINGERPRINT_RUNS = 16
FINGERPRINT_RUN = 128


class Tokens:
    """A 1-D run of token ids: in memory or memory-mapped, one file or shards in order.

    ``eos_id`` and ``vocab_size`` are what the sidecar, the flags or the tokenizer said
    (``None``: not said).

    >>> import numpy as np
    >>> t = Tokens([np.arange(5, dtype=np.uint16), np.arange(10, 13, dtype=np.uint16)])
    >>> len(t), t.read(3, 7).tolist()
    (8, [3, 4, 10, 11])
    >>> head, tail = t.split(6)
    >>> len(head), tail.read(0, 2).tolist()
    (6, [11, 12])
    """

    def __init__(self, parts: Sequence[Any], *, eos_id: int | None = None, vocab_size: int | None = None,
                 name: str = "tokens", _span: tuple[int, int] | None = None) -> None:
        self.parts = tuple(parts)
        self.eos_id, self.vocab_size, self.name = eos_id, vocab_size, name
        self._starts = [0]
        for p in self.parts:
            self._starts.append(self._starts[-1] + len(p))
        self._span = _span or (0, self._starts[-1])

    def __len__(self) -> int:
        return self._span[1] - self._span[0]

    def read(self, start: int, stop: int) -> Any:
        """Ids ``[start, stop)`` as an int64 numpy array (a copy; only these are read)."""
        import numpy as np

        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"{self.name}: ids [{start}, {stop}) outside [0, {len(self)})")
        lo, hi = start + self._span[0], stop + self._span[0]
        pieces = []
        k = bisect.bisect_right(self._starts, lo) - 1
        while lo < hi:
            end = min(hi, self._starts[k + 1])
            pieces.append(np.asarray(self.parts[k][lo - self._starts[k]:end - self._starts[k]]).astype(np.int64))
            lo, k = end, k + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, np.int64)

    def split(self, cut: int) -> tuple[Tokens, Tokens]:
        """``[0, cut)`` and ``[cut, len)``: views of the same parts (nothing is read)."""
        a = self._span[0]
        meta = dict(eos_id=self.eos_id, vocab_size=self.vocab_size, name=self.name)
        return Tokens(self.parts, _span=(a, a + cut), **meta), Tokens(self.parts, _span=(a + cut, self._span[1]), **meta)

    def sample_range(self) -> tuple[int, int]:
        """``(min, max)`` of a bounded sample: every id when there are at most
        :data:`SAMPLE_TOKENS`, else :data:`SAMPLE_CHUNKS` evenly spaced runs of
        ``SAMPLE_TOKENS / SAMPLE_CHUNKS`` ids (first and last included)."""
        lo, hi, _ = self.sample_stats()
        return lo, hi

    def sample_stats(self, token_id: int | None = None) -> tuple[int, int, bool]:
        """``(min, max, holds)`` of :meth:`sample_range`'s sample, read once: ``holds``,
        whether ``token_id`` occurs in it (the whole corpus when it has at most
        :data:`SAMPLE_TOKENS` ids; ``False`` for ``None``).

        >>> import numpy as np
        >>> t = Tokens([np.array([5, 1, 2, 5], dtype=np.uint16)])
        >>> t.sample_stats(5), t.sample_stats(3)[2]
        ((1, 5, True), False)
        """
        lo, hi, holds = None, None, False
        for ids in self._sample():
            lo = int(ids.min()) if lo is None else min(lo, int(ids.min()))
            hi = int(ids.max()) if hi is None else max(hi, int(ids.max()))
            holds = holds or (token_id is not None and bool((ids == token_id).any()))
        return lo, hi, holds

    def fingerprint(self) -> str:
        """A cheap fingerprint of these ids: a hash of their count and of
        :data:`FINGERPRINT_RUNS` evenly spaced runs of :data:`FINGERPRINT_RUN` ids (first
        and last included; every id when there are no more), read as int64 values. The
        same ids give the same fingerprint whatever holds them (a ``.bin``, ``.npy``, shards,
        text): the storage dtype is not hashed, since ids re-written in another dtype train
        the same batches, and a file read with the wrong one has other ids (or another
        count) anyway. Ids outside the runs are not read, so a change there goes unseen.

        >>> import numpy as np
        >>> a = Tokens([np.arange(5000, dtype=np.uint16)])
        >>> b = Tokens([np.arange(2000, dtype=np.int64), np.arange(2000, 5000, dtype=np.uint32)])
        >>> a.fingerprint() == b.fingerprint(), a.fingerprint() == a.split(4999)[0].fingerprint()
        (True, False)
        """
        import hashlib

        digest = hashlib.sha256(str(len(self)).encode())
        for a, b in _runs(len(self), FINGERPRINT_RUNS * FINGERPRINT_RUN, FINGERPRINT_RUNS):
            digest.update(self.read(a, b).astype("<i8").tobytes())
        return digest.hexdigest()[:16]

    def _sample(self) -> Iterator[Any]:
        for a, b in _runs(len(self), SAMPLE_TOKENS, SAMPLE_CHUNKS):
            yield self.read(a, b)


def _runs(n: int, total: int, count: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``count`` evenly spaced runs adding up to ``total`` of ``n`` ids,
    the first and last included; all of them as one run when ``n <= total``.

    >>> _runs(10, 20, 4), _runs(100, 8, 4)
    ([(0, 10)], [(0, 2), (32, 34), (65, 67), (98, 100)])
    """
    if n <= total:
        return [(0, n)]
    size = total // count
    return [(s, s + size) for s in ((n - size) * i // (count - 1) for i in range(count))]


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """Where the sidecar of a token file or shard directory is (or would be): a file's
    own (``train.bin.json``), else, when its directory has one, the directory's — a shard
    read alone is what its directory's ``tokens.json`` describes (read as the default
    uint16, a uint32 shard would train on every other id 0, with nothing said).

    >>> sidecar_path("data/train.bin").as_posix()
    'data/train.bin.json'
    """
    path = Path(path)
    if path.is_dir():
        return path / SIDECAR
    own, shared = path.with_name(path.name + ".json"), path.parent / SIDECAR
    return shared if shared.is_file() and not own.is_file() else own


def _sidecar(path: Path) -> dict[str, Any]:
    """The sidecar's settings, checked (``{}`` when there is none)."""
    side = sidecar_path(path)
    if not side.is_file():
        return {}
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{side}: not a JSON object ({e})") from None
    if not isinstance(meta, dict) or set(meta) - set(_SIDECAR_KEYS):
        extra = sorted(set(meta) - set(_SIDECAR_KEYS)) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{side}: a token-file sidecar is a JSON object of {list(_SIDECAR_KEYS)}, got {extra}")
    if "dtype" in meta and meta["dtype"] not in DTYPES:
        raise ValueError(f"{side}: dtype must be one of {list(DTYPES)}, got {meta['dtype']!r}")
    for key, least in (("eos_id", 0), ("vocab_size", 1)):
        value = meta.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise ValueError(f"{side}: {key} must be an int >= {least}, got {value!r}")
    return meta


def _settle(path: Path, key: str, flag: str, given: Any, meta: dict[str, Any]) -> Any:
    """A flag's value, or the sidecar's; both and different is an error."""
    if given is not None and key in meta and meta[key] != given:
        raise ValueError(f"{path}: {flag} {given} but its sidecar says {key} {meta[key]!r}; drop one")
    return given if given is not None else meta.get(key)


def _shards(path: Path) -> list[Path]:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in _SUFFIXES
                   and not p.name.startswith("."))
    kinds = {p.suffix.lower() for p in files}
    if not files:
        raise ValueError(f"{path}: a token directory holds .bin or .npy shards, found none")
    if len(kinds) > 1:
        raise ValueError(f"{path}: shards must be all .bin or all .npy, found both")
    return files


def _mapped(path: Path, dtype: Any, offset: int, count: int) -> Any:
    """``count`` ids of ``dtype`` from byte ``offset`` of ``path``: a read-only numpy view of
    a memory map advised ``MADV_RANDOM``. The loader reads windows at random places, and
    the kernel's default read-ahead around each page fault made a window cost ~100× more
    (np.memmap: 5.3 ms per 4 KiB window on a VM, 0.05 ms advised; docs/benchmarks/token_loader.md)."""
    import mmap

    import numpy as np

    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):  # not on every platform
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)


def _map(path: Path, dtype: str | None) -> tuple[Any, str]:
    """One shard memory-mapped (``None`` if it is empty) and its dtype's name."""
    import numpy as np

    if path.suffix.lower() == ".npy":
        # allow_pickle=False: a token file must never be able to run code. mmap_mode="r"
        # reads the header only (shape, dtype, where the data starts).
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        if array.ndim != 1:
            raise ValueError(f"{path}: expected a 1-D array of token ids, got shape {array.shape}")
        if array.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected an integer dtype for token ids, got {array.dtype}")
        if dtype is not None and array.dtype != np.dtype(dtype):
            raise ValueError(f"{path}: --data-dtype {dtype}, but the array holds {array.dtype}")
        if not array.size:
            return None, str(array.dtype)
        return _mapped(path, array.dtype, array.offset, array.size), str(array.dtype)
    dtype = dtype or "uint16"
    size, nbytes = np.dtype(dtype).itemsize, path.stat().st_size
    if nbytes % size:
        raise ValueError(f"{path}: a .bin token file holds {dtype} ids, but its size ({nbytes} bytes) is "
                         + ("odd" if size == 2 else f"not a multiple of {size}"))
    # explicit little-endian, as nanoGPT writes it on x86/ARM hosts
    return (_mapped(path, np.dtype(dtype).newbyteorder("<"), 0, nbytes // size) if nbytes else None), dtype


# The end-of-text tokens of the usual tokenizer families, tried in this order when neither
# --eos-id nor a tokenizer_config.json names one: Llama 2 / Mistral / T5, Llama 3, GPT-2 /
# Qwen / Phi, Gemma, DeepSeek (whose bars are full-width).
EOS_TOKENS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<\uff5cend\u2581of\u2581sentence\uff5c>")
# What names a tokenizer's special tokens beside its tokenizer.json (the Hugging Face layout).
TOKENIZER_CONFIGS = ("tokenizer_config.json", "special_tokens_map.json")
_LINES_AT_ONCE = 8192  # lines encoded per encode_batch call: bounds the Encoding objects alive at once


@functools.lru_cache(maxsize=4)
def _encode(text_path: str | None, tokenizer: str, documents: bool = False,
            eos_id: int | None = None) -> tuple[Any, int, int | None]:
    """Text tokenized by a ``tokenizer.json``: the ids (numpy), the tokenizer's vocabulary
    size and, with ``documents``, the EOS id that ends each line (:func:`tokenizer_eos`).

    Cached, and keyed by ``documents``: the preflight, rank 0's loader and ``--check``'s
    reference all ask, and must all get the same ids.

    The EOS ids are appended only with ``documents`` (``--document-mask``), never merely
    because the tokenizer has one. That flag is what says the text's lines are documents, as
    for byte text; without it a line break is layout (the bundled corpus is prose wrapped at
    72 columns), and the text stays one stream encoded whole, as before: a run without the
    mask keeps the ids it trained on (``--resume`` counts them), and its "\\r\\n" are content
    the tokenizer encodes as it encodes any whitespace. A masked run trains the
    model to emit the EOS at a line's end (that target is learnt; only the EOS's own, the
    next document's first token, is masked): the id generation stops at.
    """
    import numpy as np

    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the Hugging Face tokenizers library: pip install 'dtp[hf]'") from None
    try:
        tok = Tokenizer.from_file(tokenizer)
    except Exception as e:  # the library raises its own Exception subclass for a bad file
        raise ValueError(f"--tokenizer {tokenizer}: not a tokenizer.json ({_why_not_a_tokenizer(tokenizer, e)})") from None
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    text = _text(text_path)
    if not documents:
        return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=dtype), vocab, None
    if eos_id is not None and eos_id >= vocab:
        raise ValueError(f"--eos-id {eos_id}: outside the vocabulary of --tokenizer {tokenizer} (ids 0 to {vocab - 1})")
    eos = eos_id if eos_id is not None else tokenizer_eos(tok, tokenizer)
    if eos is None:
        raise ValueError(f"--document-mask: --tokenizer {tokenizer} names no end-of-text token to end each line "
                         f"(no eos_token in a tokenizer_config.json beside it, none of {' '.join(EOS_TOKENS)} in "
                         f"its vocabulary); pass --eos-id")
    # Lines end at "\n" or "\r\n" (a file saved on Windows: its "\r" is the line break, not
    # the last token of every document); not str.splitlines(), whose other breaks (\x0b,
    # \x0c, \u2028, a lone "\r", ...) can be content. replace() returns the text itself when
    # it holds no "\r\n". A final line break opens no document. Each line is encoded alone
    # (no merge across its end) and followed by the EOS, the last one too (Megatron's
    # --append-eod); a line of no ids is no document.
    lines = text.replace("\r\n", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()
    pieces = []
    for start in range(0, len(lines), _LINES_AT_ONCE):
        batch = tok.encode_batch(lines[start:start + _LINES_AT_ONCE], add_special_tokens=False)
        piece = np.asarray([i for e in batch if e.ids for i in (*e.ids, eos)], dtype=dtype)
        # A line holding the EOS: more EOS than documents. One vectorised pass, and len(e), not
        # e.ids (a new list each read): ~1 % of the encoding's time (900k lines: 0.09 s of 7 s).
        if np.count_nonzero(piece == eos) > sum(1 for e in batch if len(e)):
            _refuse_inner_eos(text_path, start + next(k for k, e in enumerate(batch) if eos in e.ids), eos, tok)
        pieces.append(piece)
    return (np.concatenate(pieces) if pieces else np.empty(0, dtype)), vocab, eos


def _refuse_inner_eos(text_path: str | None, line: int, eos: int, tok: Any) -> None:
    """Refuse line ``line`` (0-based) of the text, whose own ids hold the EOS: the mask cuts
    a document at every EOS, so the line would train as two documents, silently (as
    Megatron's preprocess_data.py would make it). The usual cause is the token's literal
    text in the data ("<|endoftext|>", "</s>"), which the tokenizer reads as the token."""
    raise ValueError(f"--document-mask: {text_path or 'the bundled corpus'}:{line + 1} holds "
                     f"{tok.id_to_token(eos)!r} (id {eos}), the EOS that ends each line: the mask would cut the "
                     f"line there into two documents; remove it from the data, or pass --eos-id an id the text "
                     f"never holds")


def tokenizer_eos(tok: Any, path: str | os.PathLike[str]) -> int | None:
    """The end-of-text id of ``tok`` (a ``tokenizers.Tokenizer`` read from ``path``): the
    ``eos_token`` of a ``tokenizer_config.json`` (else ``special_tokens_map.json``) beside
    ``path``, else the first of :data:`EOS_TOKENS` in its vocabulary; ``None`` when none is.
    A named ``eos_token`` the vocabulary lacks is a ``ValueError`` (another tokenizer's file).

    >>> class Vocab(dict):  # a Tokenizer's one method used here
    ...     token_to_id = dict.get
    >>> tokenizer_eos(Vocab({"a": 0, "<|endoftext|>": 1}), "/none/tokenizer.json")
    1
    """
    for name in TOKENIZER_CONFIGS:
        side = Path(path).parent / name
        try:
            named = json.loads(side.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):  # absent, unreadable, or not a JSON object
            continue
        named = named.get("content") if isinstance(named, dict) else named  # an AddedToken's form
        if isinstance(named, str):
            if tok.token_to_id(named) is None:
                raise ValueError(f"{side}: eos_token {named!r} is not in the vocabulary of {path}; pass --eos-id")
            return tok.token_to_id(named)
    return next((tok.token_to_id(t) for t in EOS_TOKENS if tok.token_to_id(t) is not None), None)


def _why_not_a_tokenizer(path: str, error: Exception) -> str:
    """Why the tokenizers library refused ``path``, in words: its own message for valid
    JSON that is no tokenizer reads like a syntax error ("expected `,` or `}` at line 1
    column 7" for ``{"not": "a tokenizer"}``).

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "t.json"); _ = open(path, "w").write('{"vocab": {}}')
    >>> _why_not_a_tokenizer(path, Exception("expected `,` or `}`"))
    "JSON without a tokenizer's 'model' (a file as the tokenizers library's Tokenizer.save writes it)"
    """
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        record = None
    if isinstance(record, dict) and "model" not in record:
        return "JSON without a tokenizer's 'model' (a file as the tokenizers library's Tokenizer.save writes it)"
    return " ".join(str(error).split())[:120]


def _text(path: str | None) -> str:
    raw = (resources.files("dtp.data") / "assets" / "corpus.txt").read_bytes() if path is None else Path(path).read_bytes()
    return raw.decode("utf-8", errors="replace")


def open_tokens(path: str | os.PathLike[str] | None, *, dtype: str | None = None, eos_id: int | None = None,
                tokenizer: str | os.PathLike[str] | None = None, documents: bool = False) -> Tokens:
    """The token ids ``--data`` names (formats: this module's docstring); token files are
    memory-mapped, text is tokenized in memory. With ``documents`` (``--document-mask``)
    text through ``tokenizer`` is its lines, each encoded alone and followed by the
    tokenizer's EOS (``eos_id``, else :func:`tokenizer_eos`), which is the result's ``eos_id``.

    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` for a file that holds
    no tokens, a wrong shape, dtype or size, a bad sidecar, or a flag that does not apply.

    >>> len(open_tokens(None)) > 300_000
    True
    """
    import numpy as np

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--data-dtype must be one of {list(DTYPES)}, got {dtype!r}")
    p = None if path is None else Path(path)
    if p is not None and not p.exists():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(p))
    token_file = p is not None and (p.is_dir() or p.suffix.lower() in _SUFFIXES)
    if token_file and tokenizer is not None:
        raise ValueError(f"{p}: --tokenizer tokenizes text, but this is a token file (already ids)")
    if not token_file:
        if dtype is not None:
            raise ValueError(f"{p or 'the bundled corpus'}: --data-dtype is for .bin token files, not text")
        if tokenizer is not None:
            ids, vocab, found = _encode(None if p is None else str(p), str(tokenizer), documents,
                                        eos_id if documents else None)
            eos_id = found if documents else eos_id
        else:  # byte tokens
            raw = (resources.files("dtp.data") / "assets" / "corpus.txt").read_bytes() if p is None else p.read_bytes()
            ids, vocab = np.frombuffer(raw, dtype=np.uint8), None
        if not len(ids):
            raise ValueError(f"{p}: the file holds no tokens")
        return Tokens([ids], eos_id=eos_id, vocab_size=vocab, name=str(p or "the bundled corpus"))
    meta = _sidecar(p)
    dtype = _settle(p, "dtype", "--data-dtype", dtype, meta)
    eos_id = _settle(p, "eos_id", "--eos-id", eos_id, meta)
    files = _shards(p) if p.is_dir() else [p]
    mapped = [_map(f, dtype) for f in files]
    kinds = {d for _, d in mapped}
    if len(kinds) > 1:
        raise ValueError(f"{p}: shards of different dtypes ({sorted(kinds)}); write them alike")
    parts = [m for m, _ in mapped if m is not None]
    if not parts:
        raise ValueError(f"{p}: the file holds no tokens" if not p.is_dir() else f"{p}: the shards hold no tokens")
    vocab = meta.get("vocab_size")
    if eos_id is not None and vocab is not None and eos_id >= vocab:
        raise ValueError(f"{p}: eos_id {eos_id} is outside the vocabulary [0, {vocab})")
    (kind,) = kinds
    if eos_id is not None and eos_id > _largest_id(kind):
        # It could never occur: every stream would be one document, silently.
        raise ValueError(f"{p}: eos_id {eos_id} cannot occur in {kind} ids (at most {_largest_id(kind)})")
    return Tokens(parts, eos_id=eos_id, vocab_size=vocab, name=str(p))


def _largest_id(kind: str) -> int:
    import numpy as np

    return int(np.iinfo(np.dtype(kind)).max)


class TokenStats(NamedTuple):
    """What :func:`token_stats` reads of ``--data``."""

    count: int  # tokens
    largest: int  # the largest id: the stated vocabulary's last, else the sample's largest
    end: int | None = None  # with documents=True: the id that ends a document (document_eos)
    end_seen: bool | None = None  # ... and whether the sample holds it (the whole corpus when small)


def token_stats(path: str | os.PathLike[str] | None, *, dtype: str | None = None, eos_id: int | None = None,
                tokenizer: str | os.PathLike[str] | None = None, documents: bool = False) -> TokenStats:
    """The number of tokens of ``--data`` and its largest id, reading only a bounded sample,
    once; with ``documents`` (``--document-mask``) also the id that ends a document and
    whether that sample holds it.

    The count comes from the file sizes (or ``.npy`` headers). The largest id is
    ``vocab_size - 1`` when the sidecar or tokenizer states the vocabulary, else the
    largest in :meth:`Tokens.sample_range` (an id above it that the sample missed is
    refused when a batch holds it). A negative id in the sample is a ``ValueError``, and
    so is one at or past the sidecar's ``vocab_size`` (:func:`past_vocab`), and
    ``documents`` without an id that ends one (:func:`document_eos`).

    >>> token_stats(None, documents=True)[2:]       # the bundled corpus: lines of bytes
    (10, True)
    """
    tokens = open_tokens(path, dtype=dtype, eos_id=eos_id, tokenizer=tokenizer, documents=documents)
    end = document_eos(tokens) if documents else None
    if tokenizer is not None and end is None:  # nothing to read: a tokenizer's ids are all below its vocabulary
        return TokenStats(len(tokens), tokens.vocab_size - 1)
    lo, hi, seen = tokens.sample_stats(end)
    if lo < 0:
        raise ValueError(f"{tokens.name}: token ids must be non-negative, got {lo}")
    if tokens.vocab_size is None:
        return TokenStats(len(tokens), hi, end, seen if documents else None)
    if hi >= tokens.vocab_size:  # a sidecar's word (a tokenizer's is never wrong): the model may be larger
        raise ValueError(f"{tokens.name} holds {past_vocab(tokens, hi)}")
    return TokenStats(len(tokens), tokens.vocab_size - 1, end, seen if documents else None)


def past_vocab(tokens: Tokens, token_id: int) -> str:
    """The end of the message that refuses ``token_id`` at or past the ``vocab_size`` that
    ``tokens``' sidecar states, with what to do: the model's vocabulary may be larger (the
    preset's, or the stated size rounded up to a multiple of 128), so such an id would
    train, silently, a row no tokenizer of the data makes.

    >>> import numpy as np
    >>> past_vocab(Tokens([np.zeros(1, np.uint16)], vocab_size=300, name="t.bin"), 350)
    "token id 350, but its sidecar t.bin.json says vocab_size 300 (ids 0 to 299); fix the data (another tokenizer's ids?) or the sidecar's vocab_size"
    """
    return (f"token id {token_id}, but its sidecar {sidecar_path(tokens.name)} says vocab_size {tokens.vocab_size} "
            f"(ids 0 to {tokens.vocab_size - 1}); fix the data (another tokenizer's ids?) or the sidecar's vocab_size")


def held_out_start(n_tokens: int) -> int:
    """Where the held-out split starts: tokens ``[0, cut)`` train, ``[cut, n)`` evaluate.

    >>> held_out_start(1000)
    900
    """
    return n_tokens - int(n_tokens * HELD_OUT_FRACTION)


def training_split(tokens: Tokens, held_out: bool) -> tuple[Tokens, Tokens | None]:
    """The tokens a run trains on and, when it holds some out (``dtp train --eval-every``),
    the held-out ones (:func:`held_out_start`): views, nothing is read.

    >>> import numpy as np
    >>> train, held = training_split(Tokens([np.arange(1000, dtype=np.uint16)]), True)
    >>> len(train), len(held), training_split(train, False)[1]
    (900, 100, None)
    """
    return tokens.split(held_out_start(len(tokens))) if held_out else (tokens, None)


#: Byte text has no EOS token: with ``--document-mask`` its documents are lines.
NEWLINE = 10


def document_eos(tokens: Tokens) -> int:
    """The id that ends a document in ``tokens``: its EOS id (``--eos-id``, the sidecar's, or
    the tokenizer's that ended each line: ``open_tokens(documents=True)``), or for byte
    text the newline byte; ``ValueError`` when it has none.

    >>> import numpy as np
    >>> document_eos(Tokens([np.frombuffer(b"one\\ntwo", dtype=np.uint8)]))
    10
    """
    if tokens.eos_id is not None:
        return tokens.eos_id
    if all(str(getattr(p, "dtype", "")) == "uint8" for p in tokens.parts):
        return NEWLINE
    raise ValueError(f"{tokens.name}: --document-mask needs the id that ends a document: pass --eos-id, "
                     "or give it in the token sidecar (eos_id)")
