"""Names of the objects that make up a checkpoint on the store.

::

    <ckpt>/__<rank>_<i>.<attempt>.distcp   payload (DCP's own naming plus the attempt id)
    <ckpt>/__index_<rank>.<attempt>.json   where rank's items are (manifest format 2)
    <ckpt>/.metadata                       DCP's pickled Metadata, for stock DCP readers
    <ckpt>/manifest.json                   the commit, written last and create-only
    <ckpt>/__<rank>_<i>.<attempt>.distcp.objckpt-piece-<level>-<n>
                                           a temporary piece of a payload's GCS
                                           composite upload (a crash leftover)

The attempt id in payload names means a zombie writer from a crashed attempt can
never overwrite bytes that a newer manifest points at, and it is how an
uncommitted objckpt checkpoint is told apart from a stock DCP one (stock names
have no attempt id).

Pieces are the one name here this module does not make: the store layer's
composite upload names them after the object they become
(:func:`objckpt.writers.gcs_compose.piece_key`), for any caller, so this module
recognises them through that naming's inverse (``piece_owner``) rather than
owning a copy of it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time

from objckpt.writers.gcs_compose import piece_owner
from objckpt.writers.location import is_spread_dir, spread_dir

__all__ = [
    "MANIFEST_KEY",
    "METADATA_KEY",
    "index_key",
    "index_rank",
    "is_objckpt_object",
    "is_objckpt_payload",
    "new_attempt_id",
    "payload_key",
    "writer_rank",
]

MANIFEST_KEY = "manifest.json"
METADATA_KEY = ".metadata"
# Always matched whole (fullmatch): a "$" also matches before a final newline, and a
# name a peer or a listing hands over may end in one.
_PAYLOAD = re.compile(r"__\d+_\d+\.[0-9a-f]{16}\.distcp")
_INDEX = re.compile(r"__index_\d+\.[0-9a-f]{16}\.json")
_ENTROPY = re.compile(r"[0-9a-f]{1,8}")


def new_attempt_id() -> str:
    """16 hex digits: seconds since the epoch, then random bits (sorts by time)."""
    return f"{int(time.time()) & 0xFFFFFFFF:08x}{secrets.token_hex(4)}"


def payload_key(
    rank: int, index: int, attempt: str, entropy: int = 0, persistent: bool = False
) -> str:
    """The key of payload object ``index`` of ``rank`` in ``attempt``.

    With ``entropy`` > 0 the name goes under a sub-prefix of that many hex digits
    of its hash (``3f/__0_1.<attempt>.distcp``), spreading a large job's PUTs over
    ``16**entropy`` prefixes that S3 can partition separately (by rank and index,
    the same in every save); the manifest still
    names every object, so the checkpoint stays one unit under its URL. With
    ``persistent`` too, the sub-prefix is a spread directory
    (``spread-3f/__0_1.<attempt>.distcp``), which a step directory stores in front of
    its own name, so the prefixes are the same for every step of the root
    (:func:`objckpt.writers.location.placed`).
    """
    name = f"__{rank}_{index}.{attempt}.distcp"
    if entropy <= 0:
        return name
    # The hash leaves the attempt out: each object keeps its prefix from save to save,
    # so a later save's .metadata is the last one renamed (commit.StockTemplate).
    digits = hashlib.blake2s(f"__{rank}_{index}".encode(), digest_size=8).hexdigest()[:entropy]
    return f"{spread_dir(digits) if persistent else digits}/{name}"


def index_key(rank: int, attempt: str) -> str:
    """The key of ``rank``'s index object in ``attempt`` (see :mod:`objckpt.format.index`)."""
    return f"__index_{rank}.{attempt}.json"


def index_rank(key: str) -> int | None:
    """The rank whose index object ``key`` is, or None for any other key."""
    last = key.rsplit("/", 1)[-1]
    if not _INDEX.fullmatch(last):
        return None
    return int(last[len("__index_") :].split(".", 1)[0])


def writer_rank(key: str) -> int | None:
    """The rank that wrote ``key`` (a payload or index object), else None: what a
    rank's part of a step is, wherever its files are held."""
    last = key.rsplit("/", 1)[-1]
    if _PAYLOAD.fullmatch(last):
        return int(last[2:].split("_", 1)[0])
    return index_rank(last)


def is_entropy_dir(name: str) -> bool:
    """Whether a name is a prefix-entropy sub-prefix of a checkpoint: 1-8 hex digits,
    or a spread directory (``spread-3f``), which a checkpoint that is no step
    directory holds inside it (:func:`objckpt.writers.location.placed`)."""
    return bool(_ENTROPY.fullmatch(name.rstrip("/"))) or is_spread_dir(name)


def is_objckpt_payload(name: str) -> bool:
    """Whether a key (or path's last segment) is an objckpt payload name."""
    return bool(_PAYLOAD.fullmatch(name.rsplit("/", 1)[-1]))


def is_objckpt_object(name: str) -> bool:
    """Whether a key names an object only objckpt writes (a payload, an index object,
    or a piece of a payload's GCS composite upload)."""
    last = name.rsplit("/", 1)[-1]
    owner = piece_owner(last)
    return bool(
        _PAYLOAD.fullmatch(last)
        or _INDEX.fullmatch(last)
        or (owner is not None and _PAYLOAD.fullmatch(owner))
    )
