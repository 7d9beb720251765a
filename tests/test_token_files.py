"""Token files at scale: ``--data`` as a uint16/uint32 file or a directory of shards,
memory-mapped and never read whole (the preflight reads a bounded sample, the loader its
windows); the sidecar and flags that describe them; the loader's position resumes; text
tokenized by a Hugging Face ``tokenizer.json`` made here (nothing downloaded)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dtp.data import token_files as _token_files
from dtp.data.token_files import SAMPLE_TOKENS, Tokens, open_tokens, token_stats
from dtp.data import TokenLoader


def _shards(root: Path, arrays, dtype="uint32", suffix=".bin", sidecar=None) -> Path:
    root.mkdir()
    for i, a in enumerate(arrays):
        if suffix == ".bin":
            np.asarray(a, dtype=f"<{np.dtype(dtype).str[1:]}").tofile(root / f"shard_{i:03d}.bin")
        else:
            np.save(root / f"shard_{i:03d}.npy", np.asarray(a, dtype=dtype))
    if sidecar:
        (root / "tokens.json").write_text(json.dumps(sidecar))
    return root


def _batches(loader, n):
    return [loader.next_batch() for _ in range(n)]


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_uint32_shard_directory_is_one_stream(tmp_path, suffix):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 2**20, n) for n in (1000, 7, 2345)]  # ids past uint16's range
    root = _shards(tmp_path / "d", arrays, suffix=suffix,
                   sidecar={"eos_id": 3, **({"dtype": "uint32"} if suffix == ".bin" else {})})
    tokens = open_tokens(root)
    whole = np.concatenate(arrays)
    assert len(tokens) == whole.size and tokens.eos_id == 3
    assert np.array_equal(tokens.read(990, 1010), whole[990:1010])  # across three shards
    assert token_stats(root) == (whole.size, int(whole.max()), None, None)  # small: the sample is every id
    mapped = TokenLoader(tokens, batch_size=4, seq_len=16, seed=5)
    in_memory = TokenLoader(torch.from_numpy(whole), batch_size=4, seq_len=16, seed=5)
    for a, b in zip(_batches(mapped, 6), _batches(in_memory, 6)):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["targets"], b["targets"])


def test_bin_is_uint16_unless_said(tmp_path):
    f = tmp_path / "t.bin"
    np.arange(10, dtype="<u4").tofile(f)
    assert len(open_tokens(f)) == 20  # read as uint16: twice as many ids
    assert open_tokens(f, dtype="uint32").read(0, 10).tolist() == list(range(10))
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint32", "vocab_size": 64}')
    assert len(open_tokens(f)) == 10 and token_stats(f) == (10, 63, None, None)  # the stated vocabulary (its sample below it)


def test_one_shard_of_a_directory_keeps_the_directorys_sidecar(tmp_path):
    # Before, --data d/shard_000.bin of a uint32 directory (its tokens.json) was read as
    # uint16 ids, every other one 0, and trained with nothing said.
    root = _shards(tmp_path / "d", [np.arange(3, 103)], sidecar={"dtype": "uint32", "eos_id": 7})
    one = open_tokens(root / "shard_000.bin")
    assert len(one) == 100 and one.eos_id == 7 and one.read(0, 4).tolist() == [3, 4, 5, 6]
    (root / "shard_000.bin.json").write_text('{"dtype": "uint16"}')  # its own sidecar comes first
    assert len(open_tokens(root / "shard_000.bin")) == 200
    assert _token_files.sidecar_path(tmp_path / "t.bin") == tmp_path / "t.bin.json"  # neither: where to write one


@pytest.mark.parametrize("case, match", [
    ("flag disagrees", r"--data-dtype uint16 but its sidecar says dtype 'uint32'"),
    ("unknown key", r"a JSON object of \['dtype', 'eos_id', 'vocab_size'\], got \['bos'\]"),
    ("bad dtype", r"dtype must be one of \['uint16', 'uint32'\], got 'int8'"),
    ("mixed shards", r"all \.bin or all \.npy"),
    ("empty directory", r"holds \.bin or \.npy shards, found none"),
    ("tokenizer on ids", r"--tokenizer tokenizes text, but this is a token file"),
    ("eos outside vocab", r"eos_id 9 is outside the vocabulary \[0, 8\)"),
    ("eos beyond the dtype", r"eos_id 70000 cannot occur in uint16 ids \(at most 65535\)"),
])
def test_bad_token_data_is_a_clear_error(tmp_path, case, match):
    root = tmp_path / "d"
    kwargs = {}
    if case == "flag disagrees":
        _shards(root, [[1, 2]], dtype="uint32")
        (root / "tokens.json").write_text('{"dtype": "uint32"}')
        kwargs["dtype"] = "uint16"
    elif case == "unknown key":
        _shards(root, [[1, 2]], sidecar={"bos": 1})
    elif case == "bad dtype":
        _shards(root, [[1, 2]], dtype="uint16")
        (root / "tokens.json").write_text('{"dtype": "int8"}')
    elif case == "mixed shards":
        _shards(root, [[1, 2]])
        np.save(root / "x.npy", np.arange(3))
    elif case == "empty directory":
        root.mkdir()
    elif case == "tokenizer on ids":
        _shards(root, [[1, 2]])
        kwargs["tokenizer"] = str(tmp_path / "tokenizer.json")
    elif case == "eos outside vocab":
        _shards(root, [[1, 2]], sidecar={"eos_id": 9, "vocab_size": 8})
    elif case == "eos beyond the dtype":
        _shards(root, [[1, 2]], dtype="uint16")
        kwargs["eos_id"] = 70000
    with pytest.raises(ValueError, match=match):
        open_tokens(root, **kwargs)


def test_large_file_is_never_read_whole(tmp_path, monkeypatch):
    """A file 16× the preflight's sample: the preflight reads SAMPLE_TOKENS ids, each batch its
    windows, and nothing reads the file whole (every whole-file reader is refused)."""
    n = 16 * SAMPLE_TOKENS
    f = tmp_path / "big.bin"
    np.arange(n, dtype=np.uint32).astype("<u2").tofile(f)  # 32 MiB
    read = []
    real = Tokens.read
    monkeypatch.setattr(Tokens, "read", lambda self, a, b: read.append(b - a) or real(self, a, b))

    def refuse(*a, **k):
        raise AssertionError("a token file was read whole")

    monkeypatch.setattr(np, "fromfile", refuse)
    monkeypatch.setattr(Path, "read_bytes", refuse)
    count, largest, _, _ = token_stats(f)
    assert count == n and largest == 65535  # the sample starts at every 64th of the file: it sees the wrap
    assert sum(read) == SAMPLE_TOKENS
    read.clear()
    loader = TokenLoader(open_tokens(f), batch_size=4, seq_len=64, seed=0)
    batches = _batches(loader, 3)
    assert sum(read) == 3 * 4 * 65
    assert all(torch.equal((b["tokens"] + 1) % 65536, b["targets"]) for b in batches)


def test_mapped_loader_resumes_where_it_stopped(tmp_path):
    root = _shards(tmp_path / "d", [np.arange(5000), np.arange(3000)], sidecar={"dtype": "uint32"})
    tokens = open_tokens(root)
    full = _batches(TokenLoader(tokens, batch_size=3, seq_len=32, seed=2), 5)
    first = TokenLoader(tokens, batch_size=3, seq_len=32, seed=2)
    _batches(first, 2)
    again = TokenLoader(open_tokens(root), batch_size=3, seq_len=32, seed=2)
    again.load_state_dict(first.state_dict())
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(_batches(again, 3), full[2:]))
    train, held_out = tokens.split(7000)
    assert len(train) == 7000 and held_out.read(0, 3).tolist() == [2000, 2001, 2002]
    with pytest.raises(ValueError, match="num_tokens: saved 8000, loader has 7000"):
        TokenLoader(train, batch_size=3, seq_len=32, seed=2).load_state_dict(first.state_dict())
    # As many tokens, other ids: a position there means nothing (before: resumed, silently).
    other = Tokens([np.arange(5000, dtype=np.uint32) + 1, np.arange(3000, dtype=np.uint32)])
    with pytest.raises(ValueError, match="fingerprint: saved [0-9a-f]{16}, loader has [0-9a-f]{16}"):
        TokenLoader(other, batch_size=3, seq_len=32, seed=2).load_state_dict(first.state_dict())


def test_the_fingerprint_reads_a_bounded_sample_and_not_the_storage(tmp_path, monkeypatch):
    """Tokens.fingerprint reads 16 runs of 128 ids, whatever the file's size (a --resume
    checks it before any rank starts), and the same ids give the same fingerprint in one
    file or in shards, as .bin or .npy, in any integer dtype."""
    ids = (np.arange(1 << 20) * 7919) % 50000
    one = tmp_path / "one.bin"
    ids.astype(np.uint16).tofile(one)
    shards = _shards(tmp_path / "d", [ids[:300_000], ids[300_000:]], sidecar={"dtype": "uint32"})
    np.save(tmp_path / "wide.npy", ids.astype(np.int64))
    read = []
    real = Tokens.read
    monkeypatch.setattr(Tokens, "read", lambda self, a, b: read.append(b - a) or real(self, a, b))
    prints = {open_tokens(p).fingerprint() for p in (one, shards, tmp_path / "wide.npy")}
    assert len(prints) == 1 and read == [128] * 16 * 3, read
    changed = ids.copy()
    changed[-1] += 1  # the last id is always read
    assert Tokens([changed]).fingerprint() not in prints and Tokens([ids[:-1]]).fingerprint() not in prints


TEXT = "the cat sat on the mat\nthe dog sat on the log\na cat and a dog\n" * 3


def make_tokenizer(path: Path, specials: tuple[str, ...] = ("[UNK]", "[EOS]"), *, byte_level: bool = False) -> Path:
    r"""A tiny word-level tokenizer trained here on :data:`TEXT`, with ``specials`` (the
    default's [EOS] is none of the usual end-of-text spellings, dtp's EOS_TOKENS); with
    ``byte_level`` a GPT-2-style byte-level BPE instead, which makes every character a
    token ("\r" too: the word-level one drops it as whitespace)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path.parent.mkdir(parents=True, exist_ok=True)
    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=list(specials))
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    tok.save(str(path))
    return path


def test_tokenizer_tokenizes_text(tmp_path):
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    tokens = open_tokens(text, tokenizer=tokenizer)
    expected = Tokenizer.from_file(str(tokenizer)).encode(TEXT, add_special_tokens=False).ids
    assert tokens.read(0, len(tokens)).tolist() == expected and len(expected) == 51
    vocab = Tokenizer.from_file(str(tokenizer)).get_vocab_size()
    assert token_stats(text, tokenizer=tokenizer) == (51, vocab - 1, None, None)  # the tokenizer's vocabulary
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        open_tokens(text, tokenizer=text)


def test_document_mask_encodes_each_line_and_ends_it_with_the_tokenizers_eos(tmp_path):
    """With ``documents`` (``--document-mask``) tokenized text is its lines, each encoded on its
    own and followed by the EOS (a blank line is no document, a final newline opens none);
    without it the ids are the whole text's encoding, as before (no EOS)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json", ("[UNK]", "<|endoftext|>"))
    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    lines = ["the cat sat on the mat", "", "a dog", "the log"]
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(lines) + "\n")
    expected = [i for line in lines if line for i in (*tok.encode(line, add_special_tokens=False).ids, eos)]
    tokens = open_tokens(text, tokenizer=tokenizer, documents=True)
    assert tokens.read(0, len(tokens)).tolist() == expected and tokens.eos_id == eos
    assert expected.count(eos) == 3 and expected[-1] == eos
    assert token_stats(text, tokenizer=tokenizer, documents=True) == (len(expected), tok.get_vocab_size() - 1, eos, True)
    plain = open_tokens(text, tokenizer=tokenizer)
    assert plain.read(0, len(plain)).tolist() == tok.encode(text.read_text(), add_special_tokens=False).ids
    assert eos not in plain.read(0, len(plain)).tolist() and plain.eos_id is None


def test_document_mask_ends_a_line_at_crlf_and_the_unmasked_text_stays_whole(tmp_path):
    r"""A file saved with Windows line endings has the same documents as its "\n" twin under
    ``--document-mask`` (a line's one trailing "\r" is its line break, not content: a
    byte-level BPE would otherwise end every document with a "\r" token); a "\r" elsewhere
    and the other characters ``str.splitlines`` would split at stay content. Without the
    mask the text is encoded whole, "\r\n" included: nothing there is a line's end."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    tokenizer = make_tokenizer(tmp_path / "tokenizer.json", ("<|endoftext|>",), byte_level=True)
    tok = Tokenizer.from_file(str(tokenizer))
    lines = ["the cat sat\x0con the mat", "", "a dog\rthe log\u2028a cat", "the dog\r"]
    unix, windows = tmp_path / "unix.txt", tmp_path / "windows.txt"
    unix.write_bytes("\n".join(lines).encode())  # no final line break: the last line is a document all the same
    windows.write_bytes("".join(line + "\r\n" for line in lines).encode())
    ids = [open_tokens(f, tokenizer=tokenizer, documents=True) for f in (unix, windows)]
    eos = tok.token_to_id("<|endoftext|>")
    expected = [i for line in lines if line for i in (*tok.encode(line, add_special_tokens=False).ids, eos)]
    assert [t.read(0, len(t)).tolist() for t in ids] == [expected, expected] and expected.count(eos) == 3
    assert tok.token_to_id("\u010d") in expected  # the "\r" inside line 3 and the one left of "\r\r\n"
    whole = open_tokens(windows, tokenizer=tokenizer)
    assert whole.read(0, len(whole)).tolist() == tok.encode(windows.read_bytes().decode(), add_special_tokens=False).ids


def test_document_mask_refuses_a_line_that_holds_the_eos(tmp_path):
    """A line whose own encoding holds the EOS (the literal "<|endoftext|>" in the text, which
    the tokenizer reads as the special token) would be cut in two by the mask, silently:
    refused in one line naming the file, the line (1-based), the token and its id, and the
    remedies; the unmasked text, which no EOS cuts, still tokenizes."""
    pytest.importorskip("tokenizers")
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json", ("[UNK]", "<|endoftext|>"))
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat\n\na dog<|endoftext|>the log\na cat <|endoftext|>\n")
    with pytest.raises(ValueError, match=rf"^--document-mask: {text}:3 holds '<\|endoftext\|>' \(id 1\), the EOS that "
                                         r"ends each line: the mask would cut the line there into two documents; "
                                         r"remove it from the data, or pass --eos-id an id the text never holds$"):
        token_stats(text, tokenizer=tokenizer, documents=True)
    assert len(open_tokens(text, tokenizer=tokenizer)) == 11
    assert len(open_tokens(text, tokenizer=tokenizer, documents=True, eos_id=0)) == 11 + 3  # [UNK] ends them


def test_the_eos_is_eos_id_then_a_tokenizer_config_then_a_usual_token_of_the_vocabulary(tmp_path):
    """Where the EOS comes from, first found first: ``--eos-id``; the ``eos_token`` of a
    tokenizer_config.json beside the tokenizer.json (a string, or an AddedToken's object),
    else of a special_tokens_map.json; else the first usual end-of-text token the vocabulary
    holds. A named eos_token the vocabulary lacks, or an --eos-id past it, is refused."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    text = tmp_path / "corpus.txt"
    text.write_text("a cat\na dog\n")

    def eos(case: str, sidecar: tuple[str, dict] | None = None, eos_id: int | None = None) -> int:
        tokenizer = make_tokenizer(tmp_path / case / "tokenizer.json", ("[UNK]", "[EOS]", "</s>", "<eos>"))
        if sidecar:
            (tokenizer.parent / sidecar[0]).write_text(json.dumps(sidecar[1]))
        return open_tokens(text, tokenizer=tokenizer, eos_id=eos_id, documents=True).eos_id

    vocab = Tokenizer.from_file(str(make_tokenizer(tmp_path / "tokenizer.json", ("[UNK]", "[EOS]", "</s>", "<eos>"))))
    assert eos("vocabulary") == vocab.token_to_id("</s>")  # "</s>" comes before "<eos>"
    assert eos("config", ("tokenizer_config.json", {"eos_token": "[EOS]"})) == vocab.token_to_id("[EOS]")
    added = {"eos_token": {"__type": "AddedToken", "content": "<eos>", "special": True}}
    assert eos("added token", ("tokenizer_config.json", added)) == vocab.token_to_id("<eos>")
    assert eos("map", ("special_tokens_map.json", {"eos_token": "[EOS]"})) == vocab.token_to_id("[EOS]")
    assert eos("flag", ("tokenizer_config.json", {"eos_token": "[EOS]"}), eos_id=2) == 2  # "</s>", not "[EOS]"
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: eos_token '<\|im_end\|>' is not in the "
                                         r"vocabulary of .*; pass --eos-id$"):
        eos("another's", ("tokenizer_config.json", {"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"^--eos-id 99: outside the vocabulary of --tokenizer .* \(ids 0 to 12\)$"):
        eos("past", eos_id=99)


def test_document_mask_with_a_tokenizer_of_no_eos_is_refused(tmp_path):
    """No --eos-id, no tokenizer_config.json, none of the usual end-of-text tokens (the test
    tokenizer's [EOS] is not one): nothing ends a line, refused in one line naming --eos-id;
    without the mask the text still tokenizes."""
    pytest.importorskip("tokenizers")
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    with pytest.raises(ValueError, match=r"^--document-mask: --tokenizer .*tokenizer\.json names no end-of-text "
                                         r"token to end each line \(no eos_token in a tokenizer_config\.json beside "
                                         r"it, none of </s> <\|end_of_text\|> .* in its vocabulary\); pass --eos-id$"):
        token_stats(text, tokenizer=tokenizer, documents=True)
    assert len(open_tokens(text, tokenizer=tokenizer)) == 51


def test_token_stats_sample_is_bounded(monkeypatch):
    monkeypatch.setattr(_token_files, "SAMPLE_TOKENS", 64)
    t = Tokens([np.arange(10_000, dtype=np.uint32)])
    spans = []
    real = Tokens.read
    monkeypatch.setattr(Tokens, "read", lambda self, a, b: spans.append((a, b)) or real(self, a, b))
    assert t.sample_range() == (0, 9999)  # first and last runs included
    assert len(spans) == _token_files.SAMPLE_CHUNKS and sum(b - a for a, b in spans) == 64


def test_token_stats_refuses_an_id_past_the_sidecars_vocab_size(tmp_path):
    """The sidecar states the vocabulary and the model pads it (to a multiple of 128): the
    sample is read all the same, and an id at or past the stated size is refused (one the
    padded model would hold, silently: ids of another tokenizer)."""
    f = tmp_path / "t.bin"
    np.arange(350, dtype="<u2").tofile(f)
    (tmp_path / "t.bin.json").write_text('{"vocab_size": 300}')
    with pytest.raises(ValueError, match=r"t\.bin holds token id 349, but its sidecar .*t\.bin\.json says vocab_size "
                                         r"300 \(ids 0 to 299\); fix the data .* or the sidecar's vocab_size$"):
        token_stats(f)
    (tmp_path / "t.bin.json").write_text('{"vocab_size": 350}')
    assert token_stats(f) == (350, 349, None, None)
