"""DHT keys of Lattica: run membership and content, each in its own namespace.

A provider key is a sha2-256 multihash of a namespaced string, so run ids and content hashes
can never collide with each other or with keys of other applications sharing the DHT, and
every key has the same length (34 bytes, well under the 80-byte ADD_PROVIDER limit).
"""

from __future__ import annotations

import hashlib
import re

_SHA2_256_PREFIX = b"\x12\x20"
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_CONTENT_HASH_BYTES = 64


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(
            f"run id {run_id!r} must be 1-128 characters of letters, digits, '.', '_', '-'"
        )
    return run_id


def run_namespace(run_id: str) -> str:
    return f"/lattica/run/{validate_run_id(run_id)}"


def run_key(run_id: str) -> bytes:
    """Provider key that the members of run ``run_id`` announce."""
    return _multihash(run_namespace(run_id).encode())


def content_key(content_hash: bytes) -> bytes:
    """Provider key for a tensor or checkpoint shard addressed by its content hash."""
    if not isinstance(content_hash, bytes) or not 1 <= len(content_hash) <= MAX_CONTENT_HASH_BYTES:
        raise ValueError(f"a content hash is 1-{MAX_CONTENT_HASH_BYTES} bytes")
    return _multihash(b"/lattica/content/" + content_hash)


def _multihash(data: bytes) -> bytes:
    return _SHA2_256_PREFIX + hashlib.sha256(data).digest()
