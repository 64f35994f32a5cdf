"""Node identity: one Ed25519 key per data dir, created on first start.

The key file holds the libp2p protobuf serialization of the private key. It must be readable
by its owner only (mode 0600); a key that others can read is refused rather than used, since
anyone holding it can impersonate the node and sign its replicated-state updates.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from lattica.errors import ConfigError
from lattica.files import read_capped, writing

KEY_FILE_NAME = "identity.key"
_MAX_KEY_FILE_BYTES = 4096


def load_or_create_identity(data_dir: Path) -> KeyPair:
    """Return the node's key pair, creating ``data_dir/identity.key`` (0600) if absent."""
    path = data_dir / KEY_FILE_NAME
    if not path.exists():
        return _create_identity(path)
    return load_identity(path)


def load_identity(path: Path) -> KeyPair:
    raw = read_capped(path, what="key file", max_bytes=_MAX_KEY_FILE_BYTES, private=True)
    try:
        private_key = deserialize_private_key(raw)
    except Exception:  # noqa: BLE001 - libp2p's key deserializers raise protobuf, cryptography and own errors for a damaged file
        raise ConfigError(f"key file {path} is not a valid libp2p private key") from None
    if private_key.get_type() != KeyType.Ed25519:
        raise ConfigError(f"key file {path} holds a {private_key.get_type().name} key; Ed25519 required")
    return KeyPair(private_key, private_key.get_public_key())


def _create_identity(path: Path) -> KeyPair:
    """Write a new key atomically (temporary file, fsync, rename): a full disk leaves no key
    rather than a truncated one, and says so in one line (``StorageError``)."""
    key_pair = create_new_key_pair()
    raw = key_pair.private_key.serialize()
    tmp = path.with_suffix(".tmp")
    with writing(path, what="identity key"):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if os.write(fd, raw) != len(raw):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return key_pair


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)
