"""Tokenizers: how text becomes the token ids a run trains on.

A run names its tokenizer (``tokenizer = "bytes"`` or a path to a Hugging Face ``tokenizer.json``)
and every peer of the run must use the same one: the tokenizer's ``sha256`` is what a run file
hashes, so two peers with different vocabularies never exchange a tensor.

- ``ByteTokenizer`` (the default): ids are the UTF-8 bytes, vocab 256, nothing to ship.
- ``FileTokenizer``: a Hugging Face ``tokenizers`` file, loaded locally (never downloaded).
- ``train_bpe``: a byte-level BPE tokenizer trained on local text (``p2pswarm tokenizer train``),
  on the same files and the same training part as ``--data`` would train on (the held-out part
  stays unseen), written atomically.

Importable without torch.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from p2pswarm.errors import ConfigError
from p2pswarm.model.corpus import data_corpus, read_segments

log = logging.getLogger(__name__)

BYTES_SPEC = "bytes"  # the run file's name for the byte-level default
BYTE_VOCAB = 256  # one id per byte value
BYTES_SHA256 = hashlib.sha256(b"p2pswarm/bytes").hexdigest()  # a fixed identity: nothing to hash
MIN_BPE_VOCAB = BYTE_VOCAB + 1  # the 256 byte symbols plus at least one merge, or BPE adds nothing
MAX_BPE_VOCAB = 1 << 20  # 1 Mi tokens: 4x the largest vocabularies in use; ids fit int32 targets
PROGRESS_BYTES = 8 << 20  # a progress line every 8 MiB read: a few lines a second at trainer speed
TRAIN_CHUNK = 1 << 16  # text handed to the trainer in 64 KiB pieces: bounded memory per piece


class Tokenizer(Protocol):
    name: str  # what logs and the run file call it: "bytes" or the file's name
    vocab_size: int
    sha256: str  # hex identity a run file hashes

    def encode(self, text: str) -> list[int]: ...

    def encode_bytes(self, data: bytes) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def count_bytes(self, ids) -> int: ...  # the bytes of text the ids stand for

    @property
    def is_bytes(self) -> bool: ...


@dataclass(frozen=True)
class ByteTokenizer:
    name: str = BYTES_SPEC
    vocab_size: int = BYTE_VOCAB
    sha256: str = BYTES_SHA256

    @property
    def is_bytes(self) -> bool:
        return True

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def count_bytes(self, ids) -> int:
        return int(np.asarray(ids).size)


@dataclass(frozen=True)
class FileTokenizer:
    path: Path
    name: str
    vocab_size: int
    sha256: str
    hf: Any = field(repr=False, compare=False)  # the tokenizers.Tokenizer it wraps

    @property
    def is_bytes(self) -> bool:
        return False

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FileTokenizer:
        """Load a tokenizer.json; a missing or invalid file is a one-line ConfigError."""
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path).expanduser()
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"tokenizer {path}: cannot read it ({exc.strerror})") from None
        try:
            hf = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"tokenizer {path}: not a valid tokenizer.json ({first})") from None
        vocab = hf.get_vocab_size(with_added_tokens=True)
        if vocab < 1:
            raise ConfigError(f"tokenizer {path}: its vocabulary is empty")
        return cls(path, path.name, vocab, hashlib.sha256(data).hexdigest(), hf)

    def encode(self, text: str) -> list[int]:
        fast = getattr(self.hf, "encode_batch_fast", None)  # tokenizers >= 0.20: no offsets, ~2x faster
        if fast is not None:
            return fast([text], add_special_tokens=False)[0].ids
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_bytes(self, data: bytes) -> list[int]:
        return self.encode(data.decode("utf-8", errors="replace"))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    @cached_property
    def byte_lengths(self) -> np.ndarray:
        """How many bytes of text each token id stands for (int64 [vocab]): a held-out figure in bits
        per byte counts its targets' bytes with it. Exact for byte-level BPE (a token's symbols are its
        bytes); otherwise the UTF-8 length of the token decoded alone."""
        from tokenizers import pre_tokenizers

        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        byte_level = type(self.hf.decoder).__name__ == "ByteLevel"
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            token = self.hf.id_to_token(i)
            if token is None:
                continue
            lengths[i] = len(token) if byte_level and set(token) <= alphabet else \
                len(self.hf.decode([i], skip_special_tokens=False).encode("utf-8"))
        return lengths

    def count_bytes(self, ids) -> int:
        """The bytes of text the token ids (any integer array) stand for."""
        return int(self.byte_lengths[np.asarray(ids, dtype=np.int64)].sum())


def load_tokenizer(spec: str, base_dir: str | os.PathLike[str] | None = None) -> ByteTokenizer | FileTokenizer:
    """``"bytes"`` or a path to a tokenizer.json (relative paths resolve against ``base_dir``)."""
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return FileTokenizer.load(path)


def check_vocab(vocab: int) -> None:
    if not MIN_BPE_VOCAB <= vocab <= MAX_BPE_VOCAB:
        raise ConfigError(f"--vocab {vocab}: must be in [{MIN_BPE_VOCAB}, {MAX_BPE_VOCAB}] "
                          f"(256 byte symbols plus at least one merge; at most 1 Mi tokens)")


def _texts(chunks: Iterator[bytes], progress: Callable[[int], None]) -> Iterator[str]:
    """Decoded text pieces of a byte stream (a character cut by a chunk edge is kept whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    done = reported = 0
    for chunk in chunks:
        done += len(chunk)
        if done - reported >= PROGRESS_BYTES:
            progress(done)
            reported = done
        text = decoder.decode(chunk)
        if text:
            yield text
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail
    progress(done)


def _log_progress(done: int) -> None:
    log.info("tokenizer: read %.2f MB of text", done / 1e6)


def train_bpe(data: str | os.PathLike[str], vocab: int, out: str | os.PathLike[str],
              progress: Callable[[int], None] = _log_progress) -> FileTokenizer:
    """Train a byte-level BPE tokenizer on ``data``'s training part and write it to ``out`` atomically."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_vocab(vocab)
    out = Path(out).expanduser()
    if not out.parent.is_dir():
        raise ConfigError(f"{out}: the folder {out.parent} does not exist")
    corpus = data_corpus(data, TRAIN_CHUNK)
    log.info("training a %d-token byte-level BPE on %s (%.2f MB, its held-out part left out)",
             vocab, corpus.name, corpus.train_bytes / 1e6)
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator(_texts(read_segments(corpus.train, TRAIN_CHUNK), progress), trainer=trainer)
    _save_atomic(hf, out)
    return FileTokenizer.load(out)


def _save_atomic(hf: Any, out: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        hf.save(tmp)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def cmd_train(data: str, vocab: int, out: str | os.PathLike[str]) -> int:
    """``p2pswarm tokenizer train``: train, write, and print what was written."""
    tok = train_bpe(data, vocab, out)
    print(f"{tok.path}: byte-level BPE, {tok.vocab_size} tokens, sha256 {tok.sha256}")
    return 0
