"""What the local tier's kept steps reference in other local step directories.

A step saved to the local tier with reuse names objects that an earlier local step
directory of the same node holds (``../step-<N>/<key>``, :mod:`objckpt.format.refs`).
Local retention and the start-up sweep delete step directories file by file
(:mod:`objckpt.ops.local_disk`); they must leave the files a kept step references,
or that step could not load from the tier. Each rank holds its own index objects
(and the coordinator the manifest), so each rank finds what its kept steps
reference in the files its own node holds: no collective is needed.

The files are read as untrusted input, bounded like any metadata
(:data:`objckpt.format.bounds.DEFAULT_MAX_METADATA_BYTES`); one that is too large or
malformed is skipped with a warning (what it references is then unprotected, as a
step whose index is unreadable could not load from the tier anyway).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterator

from objckpt.errors import ManifestError
from objckpt.format.bounds import DEFAULT_MAX_METADATA_BYTES
from objckpt.format.layout import MANIFEST_KEY, index_rank
from objckpt.format.refs import is_reference, root_key, split_reference
from objckpt.format.steps import step_name

__all__ = ["local_references"]

logger = logging.getLogger(__name__)


def local_references(root: str, kept: Collection[int]) -> frozenset[str]:
    """Root-relative keys (``step-<N>/<key>``) that the manifests and index objects
    of this node's directories of the ``kept`` steps reference in other steps."""
    out: set[str] = set()
    for step in kept:
        step_dir = step_name(step)
        for key in _keys_in(os.path.join(root, step_dir)):
            if is_reference(key):
                try:
                    split_reference(key, os.path.join(root, step_dir))
                except ManifestError:
                    continue
                out.add(root_key(step_dir, key))
    return frozenset(out)


def _keys_in(path: str) -> Iterator[str]:
    """The object keys named by the manifest and index objects directly in ``path``
    (never through a link)."""
    try:
        with os.scandir(path) as entries:
            names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for name in names:
        if name != MANIFEST_KEY and index_rank(name) is None:
            continue
        file = os.path.join(path, name)
        try:
            if os.lstat(file).st_size > DEFAULT_MAX_METADATA_BYTES:
                raise ValueError(f"larger than {DEFAULT_MAX_METADATA_BYTES} bytes")
            with open(file, "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError) as exc:
            logger.warning("local tier: cannot read %s for its references (%s)", file, exc)
            continue
        if not isinstance(doc, dict):
            continue
        if name == MANIFEST_KEY:
            objects = doc.get("objects")
            for o in objects if isinstance(objects, list) else ():
                if isinstance(o, dict) and isinstance(o.get("key"), str):
                    yield o["key"]
        else:
            keys = doc.get("keys")
            yield from (k for k in (keys if isinstance(keys, list) else ()) if isinstance(k, str))
