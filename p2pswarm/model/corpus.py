"""The training corpus: which bytes a stage-0 peer trains on, and which bytes everyone evaluates on.

Stage-0 peers cut micro-batches from a corpus, and replicas must agree on it without talking:
the same files in the same order, the same train / held-out split, disjoint shards of the
training part (so that replicas do not spend their compute on the same bytes) and the same
held-out bytes on every peer (so that the loss each last stage publishes is comparable).

- The default corpus needs no download: the ``.py`` sources of the running interpreter's
  standard library (test suites and site-packages excluded), in sorted relative-path order, so
  every machine with the same Python has the same corpus.
- ``--data PATH`` takes a user's text file or folder (every readable text file under it, sorted).
- The split is a stable hash of each file's relative path (about 2 % held out); when that leaves
  one side empty (a corpus of one or a few files) the tail of the byte stream is held out instead.
- Everything is streamed in chunks of ``chunk_size`` bytes: a corpus larger than RAM works.
- With a tokenizer other than bytes, ``model/token_shards.py`` tokenizes this corpus (same files,
  same split) once into memory-mapped shards; ``batches`` and ``heldout_batches`` take either
  (anything with ``train_windows``, ``heldout_windows`` and ``train_size``).

Pure and torch-free: it yields bytes (or token arrays); the compute engine turns them into tensors.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import random
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from p2pswarm.errors import ConfigError

CHUNK_SIZE = 1 << 16  # 64 KiB reads: few syscalls, and memory stays bounded whatever the corpus size
HELDOUT_PERMILLE = 20  # ~2 % held out: ~600 KB of the stdlib, enough for a stable loss estimate
PERMILLE = 1000  # the hash bucket range the split draws from
SNIFF_BYTES = 4096  # how much of a file decides "text or binary": a NUL or invalid UTF-8 means binary
SHUFFLE_WINDOWS = 1024  # shuffle-buffer size: mixes windows of the pieces read at a time (132 KB of bytes)
PIECE_BYTES = 64 * 1024  # an epoch reads the training part in pieces of files this big, in a random order
MAX_PIECES = 1 << 16  # pieces at most (larger ones for a corpus over 4 GB): the order list stays small
STDLIB_SUFFIX = ".py"  # the embedded corpus is the standard library's Python source
EXCLUDED_DIRS = frozenset({  # not the standard library proper, or test suites (huge, repetitive data)
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
})


@dataclass(frozen=True)
class CorpusFile:
    rel: str  # the POSIX relative path: the name every peer agrees on, and the split's hash input
    path: Path  # where it is on this machine
    size: int  # bytes at scan time: segments never read past it, so a growing file cannot shift windows


@dataclass(frozen=True)
class Segment:
    file: CorpusFile
    start: int  # byte offsets within the file, [start, stop)
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Corpus:
    name: str  # what error messages and logs call it: "stdlib" or the --data path
    train: tuple[Segment, ...]
    heldout: tuple[Segment, ...]
    chunk_size: int = CHUNK_SIZE
    root: Path | None = None  # the --data path (None: the embedded corpus); token shards go beside it
    unit = "bytes"  # what a window's elements are

    @property
    def train_bytes(self) -> int:
        return sum(s.size for s in self.train)

    @property
    def heldout_bytes(self) -> int:
        return sum(s.size for s in self.heldout)

    @property
    def train_size(self) -> int:
        return self.train_bytes

    def describe(self) -> str:
        return f"{self.name}: {self.train_bytes / 1e6:.1f} MB to train on, {self.heldout_bytes / 1e6:.1f} MB held out"

    def train_windows(self, length: int, offset: int = 0, order: random.Random | None = None) -> Iterator[bytes]:
        """The training part's consecutive windows, starting at training file ``offset`` (mod their count);
        with ``order``, its pieces (``PIECE_BYTES``) in an order drawn from it, starting at piece ``offset``."""
        segments = list(self.train) if order is None else _pieces(self.train, self.train_bytes)
        if order is not None:
            order.shuffle(segments)
        k = offset % max(1, len(segments))
        segments = segments[k:] + segments[:k]
        return windows(read_segments(segments, self.chunk_size), length)

    def heldout_windows(self, length: int) -> Iterator[bytes]:
        return windows(read_segments(self.heldout, self.chunk_size), length)


@dataclass(frozen=True)
class MicroBatch:
    rows: tuple  # each seq_len + 1 tokens (bytes, or a numpy id array): inputs row[:-1], targets row[1:]
    epoch: int  # how many times this shard has cycled over the training part before this batch

    @property
    def inputs(self) -> list[list[int]]:
        return [list(r[:-1]) for r in self.rows]

    @property
    def targets(self) -> list[list[int]]:
        return [list(r[1:]) for r in self.rows]


def _pieces(segments: tuple[Segment, ...], total: int) -> list[Segment]:
    """The segments cut into pieces of PIECE_BYTES (more where there would be over MAX_PIECES)."""
    size = max(PIECE_BYTES, -(-total // MAX_PIECES))
    return [Segment(s.file, a, min(a + size, s.stop)) for s in segments for a in range(s.start, s.stop, size)]


def is_heldout(rel: str) -> bool:
    """Whether a file belongs to the held-out part: a stable hash of its relative path, no random state."""
    digest = hashlib.blake2b(rel.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % PERMILLE < HELDOUT_PERMILLE


def is_text(path: Path) -> bool:
    """True when the file opens and its first bytes look like text (no NUL, valid UTF-8)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return False
    if b"\x00" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # a multi-byte character cut by the sniff window is still text
        return len(head) == SNIFF_BYTES and exc.start >= len(head) - 3
    return True


def split(name: str, files: Iterable[CorpusFile], chunk_size: int = CHUNK_SIZE, root: Path | None = None) -> Corpus:
    """The corpus with its fixed split: by path hash, or by the stream's tail when one side is empty."""
    files = sorted(files, key=lambda f: f.rel)
    train = tuple(Segment(f, 0, f.size) for f in files if not is_heldout(f.rel))
    heldout = tuple(Segment(f, 0, f.size) for f in files if is_heldout(f.rel))
    if not train or not heldout or not sum(s.size for s in heldout):
        train, heldout = _tail_split(files)
    return Corpus(name=name, train=train, heldout=heldout, chunk_size=chunk_size, root=root)


def _tail_split(files: list[CorpusFile]) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    total = sum(f.size for f in files)
    cut = total - max(1, total * HELDOUT_PERMILLE // PERMILLE)
    train: list[Segment] = []
    heldout: list[Segment] = []
    offset = 0
    for f in files:
        lo, hi = offset, offset + f.size
        if lo < cut:
            train.append(Segment(f, 0, min(hi, cut) - lo))
        if hi > cut:
            heldout.append(Segment(f, max(lo, cut) - lo, f.size))
        offset = hi
    return tuple(train), tuple(heldout)


def _scan(root: Path, suffix: str | None, excluded: frozenset[str]) -> list[CorpusFile]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excluded)
        for name in sorted(filenames):
            if suffix is not None and not name.endswith(suffix):
                continue
            path = Path(dirpath) / name
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if size and path.is_file() and is_text(path):
                found.append(CorpusFile(path.relative_to(root).as_posix(), path, size))
    return found


def stdlib_corpus(chunk_size: int = CHUNK_SIZE) -> Corpus:
    """The embedded default: the running interpreter's standard-library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _scan(root, STDLIB_SUFFIX, EXCLUDED_DIRS)
    if not files:
        raise ConfigError(f"no Python sources found in the standard library at {root}: pass --data PATH")
    return split("stdlib", files, chunk_size)


def data_corpus(path: str | os.PathLike[str], chunk_size: int = CHUNK_SIZE) -> Corpus:
    """A user's ``--data``: one text file, or every readable text file under a folder."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"--data {root}: no such file or folder")
    if root.is_dir():
        files = _scan(root, None, frozenset())
        if not files:
            raise ConfigError(f"--data {root}: the folder holds no readable, non-empty text file")
        return split(str(root), files, chunk_size, root)
    try:
        size = root.stat().st_size
    except OSError as exc:
        raise ConfigError(f"--data {root}: cannot read it ({exc.strerror})") from None
    if size == 0:
        raise ConfigError(f"--data {root}: the file is empty")
    if not is_text(root):
        raise ConfigError(f"--data {root}: not a readable text file (binary or no permission)")
    return split(str(root), [CorpusFile(root.name, root, size)], chunk_size, root)


def load_corpus(data: str | os.PathLike[str] | None = None, chunk_size: int = CHUNK_SIZE) -> Corpus:
    """``--data PATH`` when given, else the embedded standard-library corpus."""
    return stdlib_corpus(chunk_size) if data is None else data_corpus(data, chunk_size)


def read_segments(segments: Iterable[Segment], chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
    """The concatenated bytes of the segments, in chunks of at most ``chunk_size`` bytes.

    A file that vanished or shrank since the scan contributes what is left of it: a corpus on a
    shared disk can change under a long run, and a peer keeps training rather than crash.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    for seg in segments:
        try:
            with open(seg.file.path, "rb") as f:
                f.seek(seg.start)
                left = seg.size
                while left > 0:
                    chunk = f.read(min(chunk_size, left))
                    if not chunk:
                        break
                    left -= len(chunk)
                    yield chunk
        except OSError:
            continue


def windows(chunks: Iterable[bytes], length: int) -> Iterator[bytes]:
    """Consecutive, non-overlapping windows of exactly ``length`` bytes (a short tail is dropped)."""
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        pos = 0
        while len(buf) - pos >= length:
            yield bytes(buf[pos:pos + length])
            pos += length
        del buf[:pos]


def _check_shape(shard: int, n_shards: int, seq_len: int, batch_size: int) -> None:
    if n_shards < 1 or not 0 <= shard < n_shards:
        raise ValueError(f"shard {shard} is not in [0, {n_shards})")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be positive, got {seq_len}, {batch_size}")


def _shard_windows(corpus, shard: int, n_shards: int, length: int, offset: int,
                   order: random.Random) -> Iterator[bytes]:
    for i, w in enumerate(corpus.train_windows(length, offset, order)):
        if i % n_shards == shard:
            yield w


def _epoch_rng(seed: int, shard: int, epoch: int) -> random.Random:
    key = f"{seed}:{shard}:{epoch}".encode()
    return random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big"))


def _shuffled(items: Iterator, rng: random.Random, size: int) -> Iterator:
    buf: list = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        j = rng.randrange(size)
        buf[j], item = item, buf[j]
        yield item
    rng.shuffle(buf)
    yield from buf


def batches(corpus, shard: int, n_shards: int, seq_len: int, batch_size: int,
            seed: int = 0, offset: int = 0) -> Iterator[MicroBatch]:
    """Micro-batches of this shard's training windows, cycling forever.

    The training part is cut into consecutive windows of ``seq_len + 1`` tokens; shard ``s`` takes
    windows ``s, s + n_shards, s + 2 n_shards, …``, so shards are disjoint and each sees the whole
    corpus. Each epoch reads the training part in pieces (``PIECE_BYTES`` of a file; 32 Ki tokens of a
    tokenized corpus) in an order drawn from (seed, epoch), not file after file: a replica that has
    trained on 1 % of the corpus has seen pieces of all of it, not 1 % of its files in a row (which
    made the held-out loss stall where one process, reading other files, went on learning). The
    windows then pass through a bounded shuffle buffer seeded by (seed, shard, epoch):
    deterministic, different every epoch. A batch may span two epochs. ``offset`` starts the pass
    at piece ``offset`` (modulo their count) and wraps around: replicas that share a shard and seed
    but not an offset read different parts of the corpus at a time.
    """
    _check_shape(shard, n_shards, seq_len, batch_size)
    length = seq_len + 1
    available = corpus.train_size // length
    if available < n_shards:
        raise ConfigError(f"corpus {corpus.name}: its training part ({corpus.train_size} {corpus.unit}) holds "
                          f"{available} sequences of {length} {corpus.unit}, fewer than the {n_shards} shards")
    rows: list = []
    epoch = 0
    while True:
        rng = _epoch_rng(seed, shard, epoch)
        order = _epoch_rng(seed, -1, epoch)  # the pieces' order: the same for every shard (they stay disjoint)
        got = False
        for w in _shuffled(_shard_windows(corpus, shard, n_shards, length, offset, order), rng, SHUFFLE_WINDOWS):
            got = True
            rows.append(w)
            if len(rows) == batch_size:
                yield MicroBatch(tuple(rows), epoch)
                rows = []
        if not got:  # the files shrank or vanished since the scan: stop rather than spin
            raise ConfigError(f"corpus {corpus.name}: its training files can no longer be read")
        epoch += 1


def heldout_batches(corpus, seq_len: int, batch_size: int,
                    max_rows: int | None = None) -> Iterator[MicroBatch]:
    """The fixed evaluation set: the held-out part's consecutive windows, in order, the same on every peer.

    One pass; the last batch may be smaller. ``max_rows`` caps the evaluation cost (it takes the first
    rows, so peers with the same cap still evaluate on the same bytes).
    """
    _check_shape(0, 1, seq_len, batch_size)
    rows: list = []
    for i, w in enumerate(corpus.heldout_windows(seq_len + 1)):
        if max_rows is not None and i >= max_rows:
            break
        rows.append(w)
        if len(rows) == batch_size:
            yield MicroBatch(tuple(rows), 0)
            rows = []
    if rows:
        yield MicroBatch(tuple(rows), 0)


def bigram_entropy(chunks: Iterable[bytes]) -> float:
    """Conditional entropy H(next byte | byte) in bits per byte of a byte stream, from streamed counts.

    Memory is bounded by the 256 x 256 pair counts whatever the stream's length. This is what a
    bigram model fitted to the stream scores on it: the bar a language model has to beat.
    """
    pairs: Counter[int] = Counter()
    prev: int | None = None
    for chunk in chunks:
        if not chunk:
            continue
        if prev is not None:
            pairs[prev << 8 | chunk[0]] += 1
        pairs.update(a << 8 | b for a, b in itertools.pairwise(chunk))
        prev = chunk[-1]
    firsts: Counter[int] = Counter()
    for key, n in pairs.items():
        firsts[key >> 8] += n
    total = sum(firsts.values())
    if not total:
        return 0.0
    bits = -sum(n * math.log2(n / firsts[key >> 8]) for key, n in pairs.items())
    return bits / total


def heldout_bigram_entropy(corpus: Corpus) -> float:
    """The bigram entropy of the held-out part, in bits per byte (the issue's bar: ~3.49 on the stdlib)."""
    return bigram_entropy(read_segments(corpus.heldout, corpus.chunk_size))

