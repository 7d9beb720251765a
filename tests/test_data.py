"""Tests for dtp.data: tokenizer, token files, and the deterministic resumable loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtp.data import ByteTokenizer, TokenLoader, load_tokens


def _loader(tokens: torch.Tensor | None = None, **kw) -> TokenLoader:
    args = {"batch_size": 3, "seq_len": 8, "seed": 0} | kw
    return TokenLoader(torch.arange(200) if tokens is None else tokens, **args)


def _take(loader: TokenLoader, n: int) -> list[dict[str, torch.Tensor]]:
    return [loader.next_batch() for _ in range(n)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["targets"], y["targets"])
        for x, y in zip(a, b)
    )


# -- tokenizer ---------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello, world\n", "héllo wörld — ☃ 日本語 🚀"])
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == torch.int64 and ids.ndim == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    assert tok.vocab_size == 256


def test_tokenizer_decode_invalid_utf8_replaces() -> None:
    assert ByteTokenizer().decode([0xFF, 104]) == "\ufffdh"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        ByteTokenizer().decode([300])


# -- load_tokens -------------------------------------------------------------


def test_bundled_corpus() -> None:
    tokens = load_tokens()
    assert tokens.dtype == torch.int64 and tokens.ndim == 1
    assert tokens.numel() > 100_000
    assert 0 <= int(tokens.min()) and int(tokens.max()) < 256
    assert "DEVIL'S DICTIONARY" in ByteTokenizer().decode(tokens[:1000])


def test_load_txt(tmp_path) -> None:
    p = tmp_path / "a.txt"
    p.write_text("ünïcode text", encoding="utf-8")
    assert torch.equal(load_tokens(p), ByteTokenizer().encode("ünïcode text"))
    assert torch.equal(load_tokens(str(p)), load_tokens(p))


def test_load_npy(tmp_path) -> None:
    p = tmp_path / "a.npy"
    np.save(p, np.array([5, 1, 50_000, 7], dtype=np.int32))
    t = load_tokens(p)
    assert t.dtype == torch.int64 and t.tolist() == [5, 1, 50_000, 7]


def test_load_bin(tmp_path) -> None:
    p = tmp_path / "a.bin"
    np.array([0, 3, 65_535, 50_256], dtype="<u2").tofile(p)
    t = load_tokens(p)
    assert t.dtype == torch.int64 and t.tolist() == [0, 3, 65_535, 50_256]


def test_load_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokens(tmp_path / "missing.txt")

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt: the file holds no tokens"):
        load_tokens(empty)

    p2d = tmp_path / "m.npy"
    np.save(p2d, np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(ValueError, match=r"m\.npy: expected a 1-D array.*\(2, 3\)"):
        load_tokens(p2d)

    pf = tmp_path / "f.npy"
    np.save(pf, np.zeros(4, dtype=np.float32))
    with pytest.raises(ValueError, match=r"f\.npy: expected an integer dtype.*float32"):
        load_tokens(pf)

    pe = tmp_path / "e.npy"
    np.save(pe, np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError, match=r"e\.npy: the file holds no tokens"):
        load_tokens(pe)

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match=r"odd\.bin: .*\(3 bytes\) is odd"):
        load_tokens(odd)


# -- TokenLoader -------------------------------------------------------------


def test_batch_shapes_and_shift() -> None:
    loader = _loader(batch_size=4, seq_len=16)
    for batch in _take(loader, 5):
        x, y = batch["tokens"], batch["targets"]
        assert x.shape == y.shape == (4, 16)
        assert x.dtype == y.dtype == torch.int64
        # On arange data, "shifted by one" means exactly +1 everywhere.
        assert torch.equal(y, x + 1)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert bool((x[:, 0] % 16 == 0).all())  # windows start on the seq_len grid


def test_bundled_corpus_batch() -> None:
    loader = TokenLoader(load_tokens(), batch_size=2, seq_len=32, seed=1)
    batch = loader.next_batch()
    assert torch.equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])


def test_determinism() -> None:
    assert _same(_take(_loader(seed=3), 6), _take(_loader(seed=3), 6))
    assert not _same(_take(_loader(seed=3), 6), _take(_loader(seed=4), 6))


def test_resume_equals_uninterrupted() -> None:
    full = _take(_loader(), 5)

    first = _loader()
    _take(first, 2)
    state = first.state_dict()

    resumed = _loader()
    resumed.load_state_dict(state)
    assert _same(_take(resumed, 3), full[2:])


def test_resume_across_epochs() -> None:
    bpe = _loader().batches_per_epoch
    full = _take(_loader(), 3 * bpe)
    k = bpe + 1
    resumed = _loader()
    resumed.load_state_dict({**_loader().state_dict(), "step": k})
    assert _same(_take(resumed, len(full) - k), full[k:])


def test_epochs_wrap_around() -> None:
    # 200 tokens, seq_len 8 -> 24 windows; batch 3 -> 8 batches per epoch.
    loader = _loader()
    assert loader.num_windows == 24 and loader.batches_per_epoch == 8
    epoch0 = _take(loader, 8)
    assert loader.epoch == 1
    epoch1 = _take(loader, 8)
    assert loader.epoch == 2

    def starts(batches):
        return sorted(int(s) for b in batches for s in b["tokens"][:, 0])

    # Each epoch visits every window exactly once, in a fresh order.
    assert starts(epoch0) == starts(epoch1) == [8 * i for i in range(24)]
    assert not _same(epoch0, epoch1)


def test_leftover_windows_skipped() -> None:
    # 24 windows, batch 5 -> 4 full batches; the 4 leftover windows are skipped.
    loader = _loader(batch_size=5)
    assert loader.batches_per_epoch == 4
    _take(loader, 4)
    assert loader.epoch == 1


def test_loader_errors() -> None:
    with pytest.raises(ValueError, match=r"batch_size must be >= 1, got 0"):
        _loader(batch_size=0)
    with pytest.raises(ValueError, match=r"seq_len must be >= 1, got -2"):
        _loader(seq_len=-2)
    with pytest.raises(ValueError, match=r"corpus has 10 tokens, shorter than one window of seq_len \+ 1 = 17"):
        _loader(torch.arange(10), seq_len=16)
    with pytest.raises(ValueError, match=r"only 2 windows .* fewer than batch_size = 3"):
        _loader(torch.arange(17), seq_len=8)
    with pytest.raises(ValueError, match=r"tokens must be 1-D, got shape \(2, 5\)"):
        _loader(torch.zeros(2, 5, dtype=torch.int64), seq_len=2, batch_size=1)
    with pytest.raises(ValueError, match=r"integer dtype, got torch.float32"):
        _loader(torch.zeros(100))


def test_load_state_dict_mismatch() -> None:
    state = _loader(seed=1).state_dict()
    with pytest.raises(ValueError, match=r"seed: saved 1, loader has 2"):
        _loader(seed=2).load_state_dict(state)
