"""A tokenized corpus: the corpus's train and held-out parts as memory-mapped token shards.

With a tokenizer other than bytes, stage 0 does not tokenize text while it trains: the corpus
(``model/corpus.py``: the same files, the same split) is tokenized once into flat shards of
token ids, and training windows are read back from them in slices of ``read_tokens`` tokens
(``numpy.memmap``), so a corpus larger than RAM trains at bounded memory.

Layout, beside ``--data`` (``<data>.p2ptok/<tokenizer sha256[:16]>/``)::

    train-00000.bin  train-00001.bin …   token ids, little-endian uint16 (vocab ≤ 65,536) or uint32
    heldout-00000.bin …
    manifest.json                        the tokenizer's sha256, the source files (name, size,
                                         mtime), the dtype and each shard's token count

The manifest is the commit point: it is removed before a rebuild and written last, and every file
is written to a temporary name and renamed, so a crash leaves complete files or none, and a
folder without a valid manifest is rebuilt. A manifest whose tokenizer or source files differ
from now (a file added, removed, resized or touched) is stale: rebuilt. Where the folder beside
``--data`` cannot be written (a read-only data set), the shards go to the user's cache,
``$XDG_CACHE_HOME/p2pswarm/tokens/`` (``~/.cache/…``), keyed by the data path's hash; a fresh
folder beside the data is still used when someone could write it once. The embedded stdlib
corpus has no data folder: its shards always live in the user's cache.

Torch-free; numpy only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from p2pswarm.errors import ConfigError
from p2pswarm.files import write_atomic
from p2pswarm.model.corpus import HELDOUT_PERMILLE, Corpus, Segment, read_segments

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1  # bump when the layout or the tokenizing rule changes: older shards are rebuilt
CACHE_SUFFIX = ".p2ptok"  # the shards' folder beside --data: <data>.p2ptok
KEY_HEX = 16  # hex digits of the tokenizer's sha256 naming its folder: 64 bits, no collisions in practice
READ_TOKENS = 1 << 16  # tokens per memmap read: 128-256 KiB, few syscalls, bounded memory
SHARD_TOKENS = 1 << 28  # tokens per shard file: 512 MiB-1 GiB, a few files even for a large corpus
PIECE_BYTES = 1 << 20  # text handed to the tokenizer per call: cut at a newline, bounded memory
PROGRESS_BYTES = 16 << 20  # a log line every 16 MB tokenized
SHORT_VOCAB = 1 << 16  # vocabularies up to here store ids as uint16, beyond as uint32
PIECE_TOKENS = 1 << 15  # an epoch reads the training tokens in pieces this big, in a random order (model/corpus.py)
MAX_PIECES = 1 << 16  # pieces at most (larger ones beyond 2^31 tokens): the order list stays small
FILE_MODE = 0o644  # shards are a cache of public text: other local users (peers) may read them


@dataclass(frozen=True)
class Shard:
    path: Path
    tokens: int


@dataclass(frozen=True)
class TokenCorpus:
    """A corpus as token shards; ``corpus.batches`` and ``corpus.heldout_batches`` read it."""

    name: str  # the source corpus's name: "stdlib" or the --data path
    folder: Path  # where the shards and the manifest are
    dtype: str  # "uint16" or "uint32"
    train: tuple[Shard, ...]
    heldout: tuple[Shard, ...]
    heldout_bytes: int  # the held-out text's size in bytes (its tokens stand for that much text)
    read_tokens: int = READ_TOKENS
    unit = "tokens"

    @property
    def train_size(self) -> int:
        return sum(s.tokens for s in self.train)

    @property
    def heldout_size(self) -> int:
        return sum(s.tokens for s in self.heldout)

    def describe(self) -> str:
        return (f"{self.name}: {self.train_size / 1e6:.2f} M tokens to train on, {self.heldout_size / 1e6:.2f} M "
                f"held out ({self.dtype} shards in {self.folder})")

    def train_windows(self, length: int, offset: int = 0, order=None) -> Iterator[np.ndarray]:
        """The training tokens' consecutive windows, from token ``offset`` (mod their count) round to it; with
        ``order`` (a ``random.Random``), pieces of PIECE_TOKENS in an order drawn from it, from piece ``offset``."""
        if order is not None:
            size = max(PIECE_TOKENS, -(-self.train_size // MAX_PIECES))
            pieces = [r for shard, a, b in _ranges(self.train, 0, self.train_size)
                      for r in ((shard, p, min(p + size, b)) for p in range(a, b, size))]
            order.shuffle(pieces)
            k = offset % max(1, len(pieces))
            return token_windows(read_shards(pieces[k:] + pieces[:k], self.dtype, self.read_tokens), length)
        start = offset % max(1, self.train_size)
        ranges = _ranges(self.train, start, self.train_size) + _ranges(self.train, 0, start)
        return token_windows(read_shards(ranges, self.dtype, self.read_tokens), length)

    def heldout_windows(self, length: int) -> Iterator[np.ndarray]:
        ranges = _ranges(self.heldout, 0, self.heldout_size)
        return token_windows(read_shards(ranges, self.dtype, self.read_tokens), length)


def _ranges(shards: Iterable[Shard], lo: int, hi: int) -> list[tuple[Shard, int, int]]:
    """The (shard, start, stop) pieces of the token positions [lo, hi) of the shards laid end to end."""
    out, base = [], 0
    for shard in shards:
        a, b = max(lo, base), min(hi, base + shard.tokens)
        if a < b:
            out.append((shard, a - base, b - base))
        base += shard.tokens
    return out


def read_shards(ranges: Iterable[tuple[Shard, int, int]], dtype: str, read_tokens: int) -> Iterator[np.ndarray]:
    """The tokens of the ranges, in copies of at most ``read_tokens`` each: what is in memory at a time.

    A shard that vanished or shrank contributes what can be read of it (as ``read_segments``).
    """
    if read_tokens < 1:
        raise ValueError(f"read_tokens must be positive, got {read_tokens}")
    for shard, lo, hi in ranges:
        try:
            tokens = np.memmap(shard.path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        except (OSError, ValueError):
            continue
        hi = min(hi, len(tokens))
        for a in range(lo, hi, read_tokens):
            yield np.array(tokens[a:min(a + read_tokens, hi)])
        del tokens


def token_windows(chunks: Iterable[np.ndarray], length: int) -> Iterator[np.ndarray]:
    """Consecutive, non-overlapping windows of exactly ``length`` tokens (a short tail is dropped);
    each window is its own copy, so holding windows never holds the chunks they came from."""
    carry: np.ndarray | None = None
    for chunk in chunks:
        buf = chunk if carry is None or not len(carry) else np.concatenate([carry, chunk])
        n = len(buf) // length
        for i in range(n):
            yield buf[i * length:(i + 1) * length].copy()
        carry = buf[n * length:].copy()


# --- building ------------------------------------------------------------------------------------


def tokenize_corpus(corpus: Corpus, tokenizer, cache: Path | None = None, shard_tokens: int = SHARD_TOKENS,
                    read_tokens: int = READ_TOKENS) -> TokenCorpus:
    """The corpus's token shards for ``tokenizer``: reused when fresh, else (re)built (module docstring).

    ``cache`` overrides where the shards go (a folder under which ``<sha256[:16]>/`` is made).
    """
    expected = _expected_manifest(corpus, tokenizer)
    candidates = [Path(cache)] if cache is not None else _candidates(corpus)
    folders = [c / tokenizer.sha256[:KEY_HEX] for c in candidates]
    for folder in folders:
        fresh = _load_fresh(folder, expected)
        if fresh is not None:
            return _token_corpus(corpus, folder, fresh, read_tokens)
    for folder in folders:
        if _writable(folder):
            manifest = _build(corpus, tokenizer, folder, expected, shard_tokens)
            return _token_corpus(corpus, folder, manifest, read_tokens)
    raise ConfigError(f"corpus {corpus.name}: nowhere to write its token shards (tried {', '.join(map(str, folders))})")


def _candidates(corpus: Corpus) -> list[Path]:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "p2pswarm" / "tokens"
    if corpus.root is None:
        key = hashlib.sha256(sysconfig.get_paths()["stdlib"].encode()).hexdigest()[:KEY_HEX]
        return [base / f"{corpus.name}-{key}"]
    root = corpus.root.resolve()
    key = hashlib.sha256(str(root).encode()).hexdigest()[:KEY_HEX]
    return [root.parent / (root.name + CACHE_SUFFIX), base / f"{root.name}-{key}"]


def _writable(folder: Path) -> bool:
    """Whether ``folder`` exists writable or can be made (then it is made)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def _dtype(vocab: int) -> str:
    return "uint16" if vocab <= SHORT_VOCAB else "uint32"


def _expected_manifest(corpus: Corpus, tokenizer) -> dict:
    """What a fresh manifest says about its inputs (everything but the shards it lists)."""
    files: dict[str, list] = {}
    for seg in corpus.train + corpus.heldout:
        try:
            mtime = seg.file.path.stat().st_mtime_ns
        except OSError:
            mtime = 0
        files[seg.file.rel] = [seg.file.rel, seg.file.size, mtime]
    return {"version": MANIFEST_VERSION, "tokenizer": tokenizer.sha256, "vocab": tokenizer.vocab_size,
            "dtype": _dtype(tokenizer.vocab_size), "source": corpus.name,
            "heldout_permille": HELDOUT_PERMILLE, "files": sorted(files.values()),
            "train_segments": _segments_doc(corpus.train), "heldout_segments": _segments_doc(corpus.heldout)}


def _segments_doc(segments: Iterable[Segment]) -> list:
    return [[s.file.rel, s.start, s.stop] for s in segments]


def _load_fresh(folder: Path, expected: dict) -> dict | None:
    """The manifest in ``folder`` if it matches ``expected`` and every shard it lists is whole."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in expected.items()):
        return None
    itemsize = np.dtype(expected["dtype"]).itemsize
    try:
        for name, tokens in manifest["train"] + manifest["heldout"]:
            if (folder / name).stat().st_size != tokens * itemsize:
                return None
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return manifest


def _token_corpus(corpus: Corpus, folder: Path, manifest: dict, read_tokens: int) -> TokenCorpus:
    def shards(side: str) -> tuple[Shard, ...]:
        return tuple(Shard(folder / name, tokens) for name, tokens in manifest[side])

    return TokenCorpus(corpus.name, folder, manifest["dtype"], shards("train"), shards("heldout"),
                       manifest["heldout_bytes"], read_tokens)


def _build(corpus: Corpus, tokenizer, folder: Path, expected: dict, shard_tokens: int) -> dict:
    log.info("tokenizing %s with %s (%d tokens) into %s: once, %.1f MB", corpus.name, tokenizer.name,
             tokenizer.vocab_size, folder, (corpus.train_bytes + corpus.heldout_bytes) / 1e6)
    (folder / MANIFEST).unlink(missing_ok=True)  # from here until the new manifest, the folder is stale
    progress = _Progress(corpus.train_bytes + corpus.heldout_bytes)
    manifest = dict(expected)
    for side, segments in (("train", corpus.train), ("heldout", corpus.heldout)):
        writer = _ShardWriter(folder, side, expected["dtype"], shard_tokens)
        try:
            for piece in _pieces(read_segments(segments, PIECE_BYTES)):
                writer.write(tokenizer.encode_bytes(piece))
                progress.add(len(piece))
            manifest[side] = writer.close()
        finally:
            writer.discard()
    manifest["heldout_bytes"], manifest["tokenizer_name"] = corpus.heldout_bytes, tokenizer.name
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode(), mode=FILE_MODE)
    listed = {name for name, _ in manifest["train"] + manifest["heldout"]}
    for old in folder.glob("*.bin"):
        if old.name not in listed:
            old.unlink(missing_ok=True)
    log.info("tokenized %s: %d training tokens, %d held out", corpus.name,
             sum(n for _, n in manifest["train"]), sum(n for _, n in manifest["heldout"]))
    return manifest


def _pieces(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The byte stream cut after newlines into pieces of about PIECE_BYTES (a line longer than that
    is cut at a UTF-8 character boundary): the same cuts on every peer, whole characters always."""
    carry = b""
    for chunk in chunks:
        buf = carry + chunk
        cut = buf.rfind(b"\n") + 1
        if not cut and len(buf) >= PIECE_BYTES:
            cut = _char_boundary(buf)
        if cut:
            yield buf[:cut]
        carry = buf[cut:]
    if carry:
        yield carry


def _char_boundary(buf: bytes) -> int:
    """The last cut of ``buf`` before a UTF-8 lead byte or after an ASCII byte (at most 4 back)."""
    cut = len(buf)
    while cut > max(0, len(buf) - 4) and buf[cut - 1] & 0xC0 == 0x80:  # a continuation byte
        cut -= 1
    if cut and buf[cut - 1] >= 0xC0:  # the lead byte of the character being cut
        cut -= 1
    return cut or len(buf)


class _Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.reported = total, 0, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.done - self.reported >= PROGRESS_BYTES:
            self.reported = self.done
            log.info("tokenized %.0f of %.0f MB", self.done / 1e6, self.total / 1e6)


class _ShardWriter:
    """Token ids into ``<side>-NNNNN.bin`` files of at most ``shard_tokens`` ids, each written to a
    temporary name and renamed once complete."""

    def __init__(self, folder: Path, side: str, dtype: str, shard_tokens: int) -> None:
        self.folder, self.side, self.dtype, self.limit = folder, side, np.dtype(dtype).newbyteorder("<"), shard_tokens
        self.done: list[list] = []
        self.file: BinaryIO | None = None
        self.tmp = ""
        self.count = 0

    def write(self, ids: list[int]) -> None:
        data = np.asarray(ids, dtype=self.dtype)
        while len(data):
            if self.file is None:
                fd, self.tmp = tempfile.mkstemp(prefix=f".{self.side}.", suffix=".tmp", dir=self.folder)
                os.fchmod(fd, FILE_MODE)
                self.file, self.count = os.fdopen(fd, "wb"), 0
            take = data[:self.limit - self.count]
            self.file.write(take.tobytes())
            self.count += len(take)
            data = data[len(take):]
            if self.count >= self.limit:
                self._finish()

    def _finish(self) -> None:
        assert self.file is not None  # called with a shard open
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        name = f"{self.side}-{len(self.done):05d}.bin"
        os.replace(self.tmp, self.folder / name)
        self.done.append([name, self.count])
        self.file = None

    def close(self) -> list[list]:
        if self.file is not None:
            self._finish()
        return self.done

    def discard(self) -> None:
        """Remove an unfinished shard (after an error): only whole shards ever get their name."""
        if self.file is not None:
            self.file.close()
            Path(self.tmp).unlink(missing_ok=True)
            self.file = None
