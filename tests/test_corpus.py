"""The training corpus: determinism, disjoint shards, a stable split, streaming, and its errors."""

import itertools
import math
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.errors import ConfigError
from p2pswarm.model import corpus as corpus_module
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
    windows,
)


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
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1  # same windows, reshuffled


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
        all_windows = list(windows(read_segments(corpus.train, 7), length))
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
    assert len(list(heldout_batches(corpus, seq_len=49, batch_size=3, max_rows=2))[0].rows) == 2


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
