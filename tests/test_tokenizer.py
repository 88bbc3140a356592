"""Tokenizers: bytes by default, a trained byte-level BPE file, the CLI that trains one, targets
wider than a byte on the wire, and stage 0 feeding a tokenized corpus."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pswarm.cli import main
from p2pswarm.errors import ConfigError, RemoteProtocolError
from p2pswarm.model import tokenizer as tokenizer_module
from p2pswarm.model.tokenizer import (
    BYTES_SHA256,
    MAX_BPE_VOCAB,
    MIN_BPE_VOCAB,
    ByteTokenizer,
    FileTokenizer,
    load_tokenizer,
    train_bpe,
)
from p2pswarm.run.plan import MAX_TARGETS, target_bytes_per_token
from p2pswarm.swarm.evaluation import EvalBook

VOCAB = 300  # 256 byte symbols and 44 merges: trains in well under a second
ASCII = "def main(argv):\n    return 0  # the answer is {42}, not [41]!\n\tx = 'quoted' + \"more\"\n"


def sample_text() -> str:
    """Varied real text with repeats a BPE can merge: the standard library's ``os.py``."""
    return Path(os.__file__).read_text(encoding="utf-8")


def write_corpus(folder: Path, files: int = 6) -> Path:
    """A small corpus folder: ``os.py`` cut into ``files`` text files."""
    folder.mkdir(parents=True, exist_ok=True)
    text = sample_text()
    step = len(text) // files
    for i in range(files):
        (folder / f"part{i:02}.txt").write_text(text[i * step:(i + 1) * step], encoding="utf-8")
    return folder


def trained_tokenizer(folder: Path, vocab: int = VOCAB) -> FileTokenizer:
    """A byte-level BPE tokenizer trained on a small corpus under ``folder``."""
    return train_bpe(write_corpus(folder / "corpus"), vocab, folder / "tokenizer.json", progress=lambda done: None)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> FileTokenizer:
    return trained_tokenizer(tmp_path_factory.mktemp("bpe"))


# --- the byte tokenizer ---------------------------------------------------------------------------


def test_bytes_is_the_default_and_its_ids_are_the_utf8_bytes():
    tok = load_tokenizer("bytes")
    assert tok == ByteTokenizer() and tok.is_bytes and tok.vocab_size == 256 and tok.name == "bytes"
    assert tok.sha256 == BYTES_SHA256 and len(tok.sha256) == 64
    assert tok.encode("aé") == [97, 0xC3, 0xA9] and tok.encode_bytes(b"\x00\xff") == [0, 255]
    assert tok.decode(tok.encode(ASCII + "✓")) == ASCII + "✓" and tok.count_bytes(tok.encode("✓")) == 3


# --- a trained BPE file -----------------------------------------------------------------------------


def test_a_trained_tokenizer_loads_back_with_its_vocab_and_identity(bpe, tmp_path):
    assert bpe.vocab_size == VOCAB and not bpe.is_bytes and bpe.name == "tokenizer.json"
    again = load_tokenizer("tokenizer.json", base_dir=bpe.path.parent)
    assert again.sha256 == bpe.sha256 == hashlib.sha256(bpe.path.read_bytes()).hexdigest()
    assert again.vocab_size == VOCAB
    assert sorted(p.name for p in bpe.path.parent.iterdir()) == ["corpus", "tokenizer.json"]  # no temp file left


def test_ascii_round_trips_exactly_and_merges_shorten_it(bpe):
    ids = bpe.encode(ASCII)
    assert bpe.decode(ids) == ASCII and ids == bpe.hf.encode(ASCII, add_special_tokens=False).ids
    assert len(ids) < len(ASCII.encode()) and max(ids) < VOCAB
    assert bpe.count_bytes(ids) == len(ASCII.encode())


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips_and_its_tokens_count_its_bytes(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert bpe.count_bytes(ids) == len(text.encode("utf-8"))


def test_training_leaves_the_heldout_part_unseen(tmp_path):
    corpus = write_corpus(tmp_path / "one", files=1)  # one file: the tail is held out
    seen = []
    original = tokenizer_module._texts

    def spy(chunks, progress):
        for text in original(chunks, progress):
            seen.append(text)
            yield text

    tokenizer_module._texts = spy
    try:
        train_bpe(corpus, VOCAB, tmp_path / "t.json", progress=lambda done: None)
    finally:
        tokenizer_module._texts = original
    whole = (corpus / "part00.txt").read_text()
    assert whole.startswith("".join(seen)) and len("".join(seen)) < len(whole)


@pytest.mark.parametrize("spec, words", [
    ("missing.json", "cannot read it"),
    ("garbage.json", "not a valid tokenizer.json"),
    ("empty.json", "not a valid tokenizer.json"),
])
def test_a_missing_or_invalid_tokenizer_file_is_a_one_line_config_error(tmp_path, spec, words):
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ConfigError) as info:
        load_tokenizer(spec, base_dir=tmp_path)
    assert words in str(info.value) and spec in str(info.value) and "\n" not in str(info.value)


# --- the CLI ----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _keep_logging():
    """``main`` points the root logger at the captured stderr of its test: put the handlers back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = handlers, level


def test_tokenizer_train_writes_a_tokenizer_that_loads(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    assert main(["tokenizer", "train", "--data", str(corpus), "--vocab", str(VOCAB), str(tmp_path / "t.json")]) == 0
    tok = load_tokenizer(str(tmp_path / "t.json"))
    assert tok.vocab_size == VOCAB and tok.sha256 in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())["model"]["type"] == "BPE"


@pytest.mark.parametrize("args, words", [
    (["--data", "{tmp}/missing", "--vocab", "300", "{tmp}/t.json"], "no such file"),
    (["--data", "{tmp}/corpus", "--vocab", "256", "{tmp}/t.json"], f"[{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}]"),
    (["--data", "{tmp}/corpus", "--vocab", str(MAX_BPE_VOCAB + 1), "{tmp}/t.json"], "must be in"),
    (["--data", "{tmp}/corpus", "--vocab", "300", "{tmp}/nowhere/t.json"], "does not exist"),
])
def test_tokenizer_train_refuses_bad_input_in_one_line(tmp_path, capsys, args, words):
    write_corpus(tmp_path / "corpus", files=2)
    argv = ["tokenizer", "train"] + [a.format(tmp=tmp_path) for a in args]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
    assert not (tmp_path / "t.json").exists()


def test_tokenizer_train_help_explains_itself(capsys):
    with pytest.raises(SystemExit):
        main(["tokenizer", "train", "--help"])
    out = capsys.readouterr().out
    assert "byte-level BPE" in out and "--vocab" in out and "atomically" in out


# --- targets on the wire ------------------------------------------------------------------------------


def test_target_width_follows_the_vocabulary():
    assert [target_bytes_per_token(v) for v in (1, 256, 257, 65536, 65537, MAX_BPE_VOCAB)] == [1, 1, 2, 2, 4, 4]
    assert 256 * 4096 * target_bytes_per_token(MAX_BPE_VOCAB) <= MAX_TARGETS
    with pytest.raises(ValueError):
        target_bytes_per_token(0)


@settings(max_examples=60, deadline=None)
@given(vocab=st.sampled_from([256, VOCAB, 65536, 70_000, MAX_BPE_VOCAB]), rows=st.integers(1, 4),
       seq=st.integers(1, 9), data=st.data())
def test_targets_round_trip_at_every_width(vocab, rows, seq, data):
    torch = pytest.importorskip("torch")
    from p2pswarm.swarm.codec import targets_from_bytes, targets_to_bytes

    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=rows * seq, max_size=rows * seq))
    targets = torch.tensor(ids, dtype=torch.int64).reshape(rows, seq)
    wire = targets_to_bytes(targets, vocab)
    assert len(wire) == rows * seq * target_bytes_per_token(vocab)
    assert torch.equal(targets_from_bytes(wire, rows, seq, vocab), targets)
    with pytest.raises(RemoteProtocolError):
        targets_from_bytes(wire + b"\0", rows, seq, vocab)


def test_a_target_outside_the_vocabulary_is_a_protocol_error():
    pytest.importorskip("torch")
    from p2pswarm.swarm.codec import targets_from_bytes

    with pytest.raises(RemoteProtocolError):
        targets_from_bytes((VOCAB).to_bytes(2, "little") * 2, 1, 2, VOCAB)


# --- held-out figures -------------------------------------------------------------------------------


def test_a_tokenized_round_reports_bits_per_byte_and_per_token():
    book = EvalBook(expected=2)
    assert book.record(b"s", 0, 10.0, 4, 1.0, nbytes=12) is None
    done = book.record(b"s", 0, 20.0, 6, 2.0, nbytes=18)
    assert done.tokens == 10 and done.bytes == 30
    assert done.bits_per_token == pytest.approx(30 / 10 / math.log(2))
    assert done.bits_per_byte == pytest.approx(30 / 30 / math.log(2))
    plain = EvalBook(expected=1).record(b"s", 0, 10.0, 4, 1.0)  # byte tokens: as it always was
    assert plain.bits_per_byte == pytest.approx(10 / 4 / math.log(2)) and plain.bits_per_token is None


# --- stage 0 with a BPE tokenizer ---------------------------------------------------------------------


def test_stage_0_feeds_bpe_micro_batches_whose_targets_cross_the_wire(bpe, tmp_path):
    torch = pytest.importorskip("torch")
    import trio

    from p2pswarm.model.catalog import get_model
    from p2pswarm.run.training import TrainConfig
    from p2pswarm.swarm.activation import SESSION_BYTES, Ack, Forward
    from p2pswarm.swarm.buffers import Priority
    from p2pswarm.swarm.codec import targets_to_bytes
    from p2pswarm.swarm.engine import Output
    from p2pswarm.swarm.service import SwarmService

    data = write_corpus(tmp_path / "data")
    config = TrainConfig(rows=3, seq=16)
    whole = dataclasses.replace(get_model("tiny-lm/1"), vocab=bpe.vocab_size)
    last = dataclasses.replace(get_model("tiny-lm/2"), vocab=bpe.vocab_size)
    text = "".join(p.read_text() for p in sorted(data.iterdir()))

    async def main():
        feeder = SwarmService(spec=whole, stage=0, me="me", pool=None, stage_map=None, host=None, config=config,
                              data=str(data), tokenizer=bpe)
        receiver = SwarmService(spec=last, stage=1, me="you", pool=None, stage_map=None, host=None, config=config,
                                tokenizer=bpe)
        receiver.evals = EvalBook(expected=feeder.max_in_flight)
        corpus = await trio.to_thread.run_sync(feeder._load_corpus)
        assert corpus.unit == "tokens" and corpus.folder.parent == tmp_path / "data.p2ptok"
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(feeder._feed, corpus)
                while len(feeder.inbound) < feeder.max_in_flight:
                    await trio.sleep(0.01)  # polled: _feed offers from a worker thread
                nursery.cancel_scope.cancel()
        for i in range(feeder.max_in_flight):
            work = feeder.inbound.take(trio.current_time()).item.work
            assert work.tensor.shape == (3, 16) and work.targets.shape == (3, 16)
            assert torch.equal(work.tensor[:, 1:], work.targets[:, :-1]) and int(work.targets.max()) < VOCAB
            assert all(bpe.decode(row.tolist()) in text for row in work.targets)
            targets = targets_to_bytes(work.targets, VOCAB)
            assert len(targets) == 3 * 16 * 2
            hidden = b"\0" * (3 * 16 * last.width * 4)
            message = Forward(b"s" * SESSION_BYTES, i, 1, int(Priority.INFERENCE), 0, "float32",
                              (3, 16, last.width), len(targets), rounds=(-1,), path=("up",))
            assert await receiver._on_frame("up", message, hidden + targets) == Ack(i, 1)
            arrived = receiver.inbound.take(trio.current_time()).item
            assert torch.equal(arrived.work.targets, work.targets)
            receiver._record_loss(arrived, Output(loss_nats=48.0, tokens=48))
        done = receiver.evals.history[-1]
        assert done.bits_per_token == pytest.approx(1 / math.log(2)) and done.bytes > done.tokens
        narrow = targets_to_bytes(work.targets.clamp(max=255), 256)  # a peer that sends byte-wide targets
        message = Forward(b"t" * SESSION_BYTES, 0, 1, int(Priority.INFERENCE), 0, "float32", (3, 16, last.width),
                          len(narrow), rounds=(-1,), path=("liar",))
        with pytest.raises(RemoteProtocolError):
            await receiver._on_frame("liar", message, hidden + narrow)

    trio.run(main)


def test_a_tokenizer_larger_than_the_model_is_a_config_error(bpe, tmp_path):
    pytest.importorskip("torch")
    import trio

    from p2pswarm.model.catalog import get_model
    from p2pswarm.swarm.service import SwarmService

    async def main():
        svc = SwarmService(spec=get_model("tiny-lm/1"), stage=0, me="me", pool=None, stage_map=None, host=None,
                           data=str(write_corpus(tmp_path / "data", files=2)), tokenizer=bpe)
        with pytest.raises(ConfigError, match="more than the 256"):
            svc._load_corpus()

    trio.run(main)
