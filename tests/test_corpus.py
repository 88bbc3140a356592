"""The training corpus: determinism, disjoint shards, a stable split, streaming, and its errors."""

import dataclasses
import itertools
import json
import math
import string
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError
from p2pswarm.model import corpus as corpus_module
from p2pswarm.model import token_shards
from p2pswarm.model.corpus import (
    CorpusFile,
    batches,
    bigram_entropy,
    data_corpus,
    heldout_batches,
    heldout_bigram_entropy,
    is_heldout,
    load_corpus,
    read_segments,
    split,
    stdlib_corpus,
)
from p2pswarm.model.token_shards import Shard, TokenCorpus, token_windows, tokenize_corpus
from tests.test_tokenizer import trained_tokenizer, write_corpus


@pytest.fixture(scope="module", name="bpe")
def bpe_fixture(tmp_path_factory):  # as tests/test_tokenizer.py's
    return trained_tokenizer(tmp_path_factory.mktemp("bpe"))


def write_tree(root: Path, contents: list[bytes]) -> None:
    for i, data in enumerate(contents):
        sub = root / f"d{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:03}.txt").write_bytes(data)


def take(it, n):
    return list(itertools.islice(it, n))


@pytest.fixture(scope="module")
def stdlib():
    return stdlib_corpus()


def test_the_stdlib_corpus_has_a_training_and_a_heldout_part(stdlib):
    assert stdlib.name == "stdlib"
    assert stdlib.train_bytes > 1_000_000 and stdlib.heldout_bytes > 10_000
    rels = [s.file.rel for s in stdlib.train]
    assert rels == sorted(rels) and all(r.endswith(".py") for r in rels)
    assert not any(part in {"test", "tests", "site-packages", "idle_test"}
                   for r in rels for part in r.split("/"))
    assert {s.file.rel for s in stdlib.train}.isdisjoint(s.file.rel for s in stdlib.heldout)
    assert all(is_heldout(s.file.rel) for s in stdlib.heldout)


def test_the_stdlib_corpus_is_the_same_on_every_scan(stdlib):
    again = load_corpus(None)
    assert again == stdlib
    first = take(batches(stdlib, 1, 3, seq_len=64, batch_size=4, seed=5), 3)
    assert first == take(batches(again, 1, 3, seq_len=64, batch_size=4, seed=5), 3)
    assert all(len(row) == 65 for b in first for row in b.rows)


def test_the_stdlib_heldout_bigram_entropy_is_a_real_bar(stdlib):
    assert 2.5 < heldout_bigram_entropy(stdlib) < 4.5


def test_two_runs_give_the_same_batches_and_seeds_change_the_order(tmp_path):
    write_tree(tmp_path, [bytes(string.ascii_letters * (i + 1), "ascii") for i in range(5)])
    corpus = data_corpus(tmp_path)
    one = take(batches(corpus, 0, 2, seq_len=15, batch_size=3, seed=7), 40)
    two = take(batches(data_corpus(tmp_path), 0, 2, seq_len=15, batch_size=3, seed=7), 40)
    assert one == two
    assert take(batches(corpus, 0, 2, seq_len=15, batch_size=3, seed=8), 40) != one
    per_shard = len(range(0, corpus.train_bytes // 16, 2))  # shard 0 of 2 takes windows 0, 2, 4, …
    rows = [r for b in one for r in b.rows]
    epoch0, epoch1 = rows[:per_shard], rows[per_shard:2 * per_shard]
    assert one[-1].epoch >= 2  # it cycles forever over the training part
    assert epoch0 != epoch1  # every epoch its own order of pieces, cut into windows anew


def test_inputs_and_targets_are_the_row_shifted_by_one(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(32, 127)) * 5)
    batch = next(batches(data_corpus(tmp_path), 0, 1, seq_len=8, batch_size=2))
    for row, inputs, targets in zip(batch.rows, batch.inputs, batch.targets):
        assert len(inputs) == len(targets) == 8
        assert inputs[1:] == targets[:-1] and list(row) == inputs + targets[-1:]


@settings(max_examples=40)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
       n_shards=st.integers(1, 5), seq_len=st.integers(1, 20), seed=st.integers(0, 3))
def test_shards_are_disjoint_and_cover_the_training_part(sizes, n_shards, seq_len, seed):
    length = seq_len + 1
    with tempfile.TemporaryDirectory() as tmp:
        # varied text (hex of a counter), files of the drawn sizes
        write_tree(Path(tmp), [f"{i:x}".encode() * size for i, size in enumerate(sizes)])
        corpus = data_corpus(tmp, chunk_size=7)
        # the first epoch's windows: the training pieces in that epoch's order (the same for every shard)
        all_windows = list(corpus.train_windows(length, 0, corpus_module._epoch_rng(seed, -1, 0)))
        if len(all_windows) < n_shards:
            with pytest.raises(ConfigError):
                next(batches(corpus, 0, n_shards, seq_len, 1, seed))
            return
        seen = []
        for shard in range(n_shards):
            mine = len(all_windows[shard::n_shards])
            rows = [r for b in take(batches(corpus, shard, n_shards, seq_len, 1, seed), mine)
                    for r in b.rows]
            assert sorted(rows) == sorted(all_windows[shard::n_shards])
            seen.append(set(range(shard, len(all_windows), n_shards)))
        assert set().union(*seen) == set(range(len(all_windows)))
        assert sum(map(len, seen)) == len(all_windows)


@settings(max_examples=60)
@given(st.lists(st.text(string.ascii_letters + "/._", min_size=1, max_size=30), unique=True, max_size=40))
def test_the_split_depends_on_each_path_alone(rels):
    files = [CorpusFile(r, Path("/nonexistent") / r, 10) for r in rels]
    verdicts = {r: is_heldout(r) for r in rels}
    for subset in (files, files[::2], list(reversed(files))):
        corpus = split("x", subset)
        if corpus.heldout and all(s.start == 0 and s.stop == s.file.size for s in corpus.heldout):
            assert all(verdicts[s.file.rel] for s in corpus.heldout)
            assert not any(verdicts[s.file.rel] for s in corpus.train)


def test_the_heldout_share_is_about_two_percent():
    rels = [f"pkg/module_{i}.py" for i in range(20_000)]
    share = sum(map(is_heldout, rels)) / len(rels)
    assert 0.015 < share < 0.025


def test_a_single_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(b"x" * 9_000 + b"y" * 1_000)
    corpus = data_corpus(path)
    assert corpus.train_bytes + corpus.heldout_bytes == 10_000
    assert corpus.heldout_bytes == 200
    assert b"".join(read_segments(corpus.heldout)) == b"y" * 200
    held = list(heldout_batches(corpus, seq_len=49, batch_size=3))
    assert [len(b.rows) for b in held] == [3, 1]
    assert held == list(heldout_batches(data_corpus(path), seq_len=49, batch_size=3))
    assert len(next(iter(heldout_batches(corpus, seq_len=49, batch_size=3, max_rows=2))).rows) == 2


def test_files_are_read_in_chunks_of_the_chunk_size(tmp_path):
    data = bytes(range(32, 127)) * 50
    (tmp_path / "big.txt").write_bytes(data)
    corpus = data_corpus(tmp_path, chunk_size=100)
    chunks = list(read_segments(corpus.train + corpus.heldout, corpus.chunk_size))
    assert len(chunks) > len(data) // 100 - 1 and max(map(len, chunks)) == 100
    assert b"".join(chunks) == data
    small = take(batches(corpus, 0, 1, seq_len=250, batch_size=2, seed=1), 5)
    large = take(batches(data_corpus(tmp_path, chunk_size=1 << 20), 0, 1, 250, 2, seed=1), 5)
    assert small == large


def test_binary_and_empty_files_in_a_folder_are_skipped(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 " * 100)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "good.txt").write_text("hello world\n" * 100)
    corpus = data_corpus(tmp_path)
    assert {s.file.rel for s in corpus.train + corpus.heldout} == {"good.txt"}


def test_a_multibyte_character_cut_by_the_sniff_window_is_still_text(tmp_path):
    path = tmp_path / "utf8.txt"
    path.write_bytes(b"a" * (corpus_module.SNIFF_BYTES - 1) + "é".encode() * 10)
    assert corpus_module.is_text(path)


def made(path: Path, files: dict[str, bytes]) -> Path:
    """``path``, after writing ``files`` (name -> content) under it (a folder when names nest)."""
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


@pytest.mark.parametrize("setup, words", [
    (lambda p: p / "missing", "no such file"),
    (lambda p: made(p, {"empty.txt": b""}) / "empty.txt", "empty"),
    (lambda p: made(p, {"x.bin": b"\x00" * 64}) / "x.bin", "not a readable text file"),
    (lambda p: made(p, {"d/x.bin": b"\x7fELF\x00", "d/e.txt": b""}) / "d", "no readable"),
    (lambda p: made(p / "e", {}) if (p / "e").mkdir() is None else None, "no readable"),
])
def test_bad_data_paths_are_one_line_config_errors(tmp_path, setup, words):
    path = setup(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_corpus(path)
    message = str(info.value)
    assert str(path) in message and words in message and "\n" not in message


def test_bad_shard_arguments_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("abc" * 100)
    corpus = data_corpus(tmp_path)
    with pytest.raises(ValueError):
        next(batches(corpus, 2, 2, 8, 1))
    with pytest.raises(ValueError):
        next(batches(corpus, 0, 1, 0, 1))


def test_the_bigram_entropy_of_known_strings():
    assert bigram_entropy([b"ab" * 100]) == 0.0
    expected = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))
    assert bigram_entropy([b"aaab"]) == pytest.approx(expected)
    assert bigram_entropy([b"a", b"a", b"", b"ab"]) == pytest.approx(expected)  # pairs span chunks
    assert bigram_entropy([]) == 0.0 and bigram_entropy([b"x"]) == 0.0


# --- tokenized corpora: memory-mapped token shards ------------------------------------------------


def token_corpus_of(ids: np.ndarray, folder: Path, read_tokens: int) -> TokenCorpus:
    """A TokenCorpus of one training shard holding ``ids`` (and a one-token held-out shard)."""
    folder.mkdir(parents=True, exist_ok=True)
    ids.astype("<u4").tofile(folder / "train-00000.bin")
    ids[:1].astype("<u4").tofile(folder / "heldout-00000.bin")
    return TokenCorpus("ids", folder, "uint32", (Shard(folder / "train-00000.bin", len(ids)),),
                       (Shard(folder / "heldout-00000.bin", 1),), 1, read_tokens)


def test_a_shard_larger_than_its_read_buffer_yields_every_window_through_bounded_reads(tmp_path, monkeypatch):
    total, read_tokens, seq_len = 150_000, 1024, 63  # a 600 KB shard read 4 KB at a time
    corpus = token_corpus_of(np.arange(total), tmp_path, read_tokens)
    reads: list[int] = []
    original = token_shards.read_shards

    def counted(ranges, dtype, size):
        for chunk in original(ranges, dtype, size):
            reads.append(chunk.nbytes)
            yield chunk

    monkeypatch.setattr(token_shards, "read_shards", counted)
    n_windows = total // (seq_len + 1)
    rows = [r for b in take(batches(corpus, 0, 1, seq_len, 1, seed=3), n_windows) for r in b.rows]
    assert all(b.epoch == 0 for b in take(batches(corpus, 0, 1, seq_len, n_windows, seed=3), 1))
    assert max(reads) == read_tokens * 4 and len(reads) >= total // read_tokens  # never more at a time
    starts = sorted(int(r[0]) for r in rows)
    assert len(set(starts)) == n_windows  # every window once, each consecutive ids
    assert all(np.array_equal(r, np.arange(r[0], r[0] + seq_len + 1)) and r.base is None for r in rows)
    assert len({s % (seq_len + 1) for s in starts}) == 1  # windows on one alignment: none is lost


def test_a_tokenized_corpus_keeps_the_byte_corpus_split_and_text(tmp_path, bpe):
    data = write_corpus(tmp_path / "data")
    corpus = data_corpus(data)
    tokens = tokenize_corpus(corpus, bpe)
    assert tokens.folder == tmp_path / "data.p2ptok" / bpe.sha256[:16] and tokens.dtype == "uint16"
    train = np.concatenate([np.fromfile(s.path, "<u2") for s in tokens.train])
    held = np.concatenate([np.fromfile(s.path, "<u2") for s in tokens.heldout])
    assert bpe.decode(train.tolist()).encode() == b"".join(read_segments(corpus.train))
    assert bpe.decode(held.tolist()).encode() == b"".join(read_segments(corpus.heldout))
    assert tokens.heldout_bytes == corpus.heldout_bytes and len(train) == tokens.train_size
    manifest = json.loads((tokens.folder / "manifest.json").read_text())
    assert manifest["tokenizer"] == bpe.sha256 and manifest["dtype"] == "uint16"
    assert [f[:2] for f in manifest["files"]] == sorted([s.file.rel, s.file.size]
                                                        for s in corpus.train + corpus.heldout)
    held_rows = [r for b in heldout_batches(tokens, 15, 4) for r in b.rows]
    assert np.array_equal(np.concatenate(held_rows), held[:len(held_rows) * 16])
    assert not [p for p in tokens.folder.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_fresh_shards_are_reused_and_stale_ones_rebuilt(tmp_path, bpe):
    data = write_corpus(tmp_path / "data")
    first = tokenize_corpus(data_corpus(data), bpe)
    stamp = first.train[0].path.stat().st_mtime_ns
    assert tokenize_corpus(data_corpus(data), bpe) == first and first.train[0].path.stat().st_mtime_ns == stamp
    with open(data / "part01.txt", "a") as f:
        f.write("\nmore text, so the corpus changed\n")
    second = tokenize_corpus(data_corpus(data), bpe)
    assert second.train_size + second.heldout_size > first.train_size + first.heldout_size
    second.train[0].path.write_bytes(b"\0\0")  # damaged: its size no longer matches the manifest
    third = tokenize_corpus(data_corpus(data), bpe)
    assert third == second and third.train[0].path.stat().st_size == third.train[0].tokens * 2


def test_a_crash_while_tokenizing_leaves_no_half_written_shard(tmp_path, bpe, monkeypatch):
    data = write_corpus(tmp_path / "data")
    calls = []

    def failing(piece: bytes) -> list[int]:
        calls.append(piece)
        if len(calls) == 2:
            raise RuntimeError("killed")
        return bpe.encode_bytes(piece)

    broken = dataclasses.replace(bpe)
    object.__setattr__(broken, "encode_bytes", failing)
    monkeypatch.setattr(token_shards, "PIECE_BYTES", 4096)  # several pieces, so the crash is mid-way
    with pytest.raises(RuntimeError):
        tokenize_corpus(data_corpus(data), broken, shard_tokens=1000)
    folder = tmp_path / "data.p2ptok" / bpe.sha256[:16]
    assert not (folder / "manifest.json").exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # the unfinished shard is gone
    assert all(p.stat().st_size == 2000 for p in folder.glob("*.bin"))  # what is named is whole
    rebuilt = tokenize_corpus(data_corpus(data), bpe, shard_tokens=1000)
    assert len(rebuilt.train) > 1 and (folder / "manifest.json").exists()


def test_a_data_folder_whose_side_cannot_be_written_uses_the_user_cache(tmp_path, bpe, monkeypatch):
    data = write_corpus(tmp_path / "data")
    (tmp_path / "data.p2ptok").write_text("not a folder")  # unwritable as a folder, even for root
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokens = tokenize_corpus(data_corpus(data), bpe)
    assert tokens.folder.is_relative_to(tmp_path / "cache" / "p2pswarm" / "tokens")
    assert tokenize_corpus(data_corpus(data), bpe) == tokens


@settings(max_examples=60)
@given(st.lists(st.integers(0, 999), max_size=300), st.lists(st.integers(1, 40), min_size=1, max_size=20),
       st.integers(1, 17))
def test_token_windows_are_the_windows_of_the_concatenation_whatever_the_chunks(ids, cuts, length):
    data, chunks, pos = np.array(ids, dtype=np.uint16), [], 0
    for cut in itertools.cycle(cuts):
        if pos >= len(data):
            break
        chunks.append(data[pos:pos + cut])
        pos += cut
    got = [w.tolist() for w in token_windows(chunks, length)]
    assert got == [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]


@settings(max_examples=60)
@given(st.text(max_size=400), st.integers(1, 64))
def test_tokenizer_pieces_are_whole_characters_and_lose_nothing(text, chunk):
    data = text.encode()
    original = token_shards.PIECE_BYTES
    token_shards.PIECE_BYTES = 16  # cut long lines often
    try:
        pieces = list(token_shards._pieces(data[i:i + chunk] for i in range(0, len(data), chunk)))
    finally:
        token_shards.PIECE_BYTES = original
    assert b"".join(pieces) == data
    for piece in pieces:
        piece.decode("utf-8")  # raises if a character was cut
