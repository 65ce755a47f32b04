"""Names of the objects that make up a checkpoint on the store.

::

    <ckpt>/__<rank>_<i>.<attempt>.distcp   payload (DCP's own naming plus the attempt id)
    <ckpt>/.metadata                       DCP's pickled Metadata, for stock DCP readers
    <ckpt>/manifest.json                   the commit, written last and create-only

The attempt id in payload names means a zombie writer from a crashed attempt can
never overwrite bytes that a newer manifest points at, and it is how an
uncommitted objckpt checkpoint is told apart from a stock DCP one (stock names
have no attempt id).
"""

from __future__ import annotations

import hashlib
import inspect
import re
import secrets
import time

from fsspec import AbstractFileSystem

__all__ = [
    "MANIFEST_KEY",
    "METADATA_KEY",
    "PROBE_KEY",
    "is_objckpt_payload",
    "list_names",
    "new_attempt_id",
    "payload_key",
    "read_whole",
]

MANIFEST_KEY = "manifest.json"
METADATA_KEY = ".metadata"
#: Key of the empty multipart upload a preflight begins and aborts to prove write
#: access; no object is ever created under it.
PROBE_KEY = ".objckpt-write-probe"
_PAYLOAD = re.compile(r"^__\d+_\d+\.([0-9a-f]{16})\.distcp$")
_ENTROPY = re.compile(r"^[0-9a-f]{1,8}$")


def new_attempt_id() -> str:
    """16 hex digits: seconds since the epoch, then random bits (sorts by time)."""
    return f"{int(time.time()) & 0xFFFFFFFF:08x}{secrets.token_hex(4)}"


def payload_key(rank: int, index: int, attempt: str, entropy: int = 0) -> str:
    """The key of payload object ``index`` of ``rank`` in ``attempt``.

    With ``entropy`` > 0 the name goes under a sub-prefix of that many hex digits
    of its hash (``3f/__0_1.<attempt>.distcp``), spreading a large job's PUTs over
    ``16**entropy`` prefixes that S3 can partition separately; the manifest still
    names every object, so the checkpoint stays one unit under its URL.
    """
    name = f"__{rank}_{index}.{attempt}.distcp"
    if entropy <= 0:
        return name
    return f"{hashlib.blake2s(name.encode(), digest_size=8).hexdigest()[:entropy]}/{name}"


def is_entropy_dir(name: str) -> bool:
    """Whether a name is a prefix-entropy sub-prefix (1-8 hex digits)."""
    return bool(_ENTROPY.match(name.rstrip("/")))


def list_names(fs: AbstractFileSystem, path: str) -> list[str]:
    """Names of the objects directly under ``path`` (empty if there is none).

    One listing answers every "what is here" question (manifest? .metadata?
    objckpt payload?) in a single request instead of one per object.
    """
    fs.invalidate_cache(path)
    try:
        return [str(n).rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def read_whole(fs: AbstractFileSystem, path: str) -> bytes:
    """A small object (manifest, ``.metadata``) in one GET.

    s3fs's ``cat_file`` first HEADs the object to decide whether to split it into
    parallel ranges. For a small object that is a wasted round trip, and a HEAD's
    403 has no body, so a refused key and a wrong secret both read "Forbidden";
    the GET's answer says which (``InvalidAccessKeyId``, ``SignatureDoesNotMatch``).
    """
    inner = getattr(fs, "_cat_file", None)  # async filesystems only
    if inner is not None and "max_concurrency" in inspect.signature(inner).parameters:
        return bytes(fs.cat_file(path, max_concurrency=1))
    return bytes(fs.cat_file(path))


def is_objckpt_payload(name: str) -> bool:
    """Whether a key (or path's last segment) is an objckpt payload name."""
    return bool(_PAYLOAD.match(name.rsplit("/", 1)[-1]))
