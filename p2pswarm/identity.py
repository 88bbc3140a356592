"""A node's persistent identity: an Ed25519 key in a file of mode 0600, and its peer id.

The file holds the libp2p protobuf serialisation of the private key (the format go-libp2p
and js-libp2p use), so a key can move between implementations. Ed25519 only: its peer id
embeds the public key, which lets anyone verify a record signed by that peer from the id alone.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from p2pswarm.errors import ConfigError

if TYPE_CHECKING:  # libp2p is imported where a key is made or read: importing this module stays cheap
    from libp2p.crypto.keys import KeyPair
    from libp2p.peer.id import ID

KEY_FILE_MODE = 0o600  # only the owner may read a private key
MAX_KEY_FILE_BYTES = 4096  # an Ed25519 key file is 36 bytes; anything far larger is not one


@dataclass(frozen=True)
class Identity:
    """A loaded key pair and the peer id it gives."""

    key_pair: KeyPair
    peer_id: ID

    @property
    def peer_id_text(self) -> str:
        return str(self.peer_id)

    def sign(self, data: bytes) -> bytes:
        return self.key_pair.private_key.sign(data)


def generate_identity() -> Identity:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    key_pair = create_new_key_pair()
    return Identity(key_pair, ID.from_pubkey(key_pair.public_key))


def write_key(path: Path, identity: Identity) -> None:
    """Write the key atomically with mode 0600; refuse to overwrite an existing key.

    ConfigError, never an OSError, when the file cannot be written (a file where a folder
    should be, a read-only place, a full disk): the CLI prints it as one line.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        if path.exists():
            raise ConfigError(f"key file {path} already exists; refusing to overwrite it")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, KEY_FILE_MODE)
        try:
            os.write(fd, identity.key_pair.private_key.serialize())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        _remove_quietly(tmp)
        reason = exc.strerror or str(exc)
        if isinstance(exc, (FileExistsError, NotADirectoryError)):  # from mkdir: "File exists" misleads
            reason = "a file stands where a folder on its path should be"
        raise ConfigError(f"cannot write key file {path}: {reason}") from None


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # never created, or the place is not writable: nothing to clean up
        pass


def load_key(path: Path) -> Identity:
    """Load a key file, checking its permissions and content; ConfigError on any problem."""
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.crypto.keys import KeyPair
    from libp2p.crypto.serialization import deserialize_private_key
    from libp2p.peer.id import ID

    path = Path(path)
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"key file {path} is not a regular file")
    if info.st_mode & 0o077:
        raise ConfigError(
            f"key file {path} has mode {stat.S_IMODE(info.st_mode):04o}; "
            f"it must be readable by its owner only (chmod 600 {path})"
        )
    if info.st_size > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"key file {path} is {info.st_size} bytes; not a p2pswarm key")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    try:
        private_key = deserialize_private_key(data)
    except Exception:
        raise ConfigError(f"key file {path} does not hold a libp2p private key") from None
    if not isinstance(private_key, Ed25519PrivateKey):
        raise ConfigError(f"key file {path} holds a non-Ed25519 key; p2pswarm needs Ed25519")
    key_pair = KeyPair(private_key, private_key.get_public_key())
    return Identity(key_pair, ID.from_pubkey(key_pair.public_key))


def load_or_create_key(path: Path | None) -> Identity:
    """The key at ``path``, created on first use; a fresh ephemeral key when ``path`` is None."""
    if path is None:
        return generate_identity()
    path = Path(path)
    if not path.exists():
        write_key(path, generate_identity())
    return load_key(path)
