"""The bytes of planned ranges: from the local copy where it holds them intact, else the store.

Store reads go through fsspec's ``cat_ranges``, all ranges of a batch at once
(:func:`~objckpt.writers.reads.read_ranges`: a range past an object's end reads
as empty, whatever the store answers), and
a range larger than ``ReadOptions.range_size`` is split into pieces fetched in
parallel. A response cut off mid-body is retried as its own request by the store's
retry layer (a store without one gets its batch retried whole). A piece missing
or shorter than the manifest says is a :class:`SizeMismatchError` naming the
object (and, for bytes the step reuses from an earlier step, both steps): the
manifest lists it, so the store lost it.
"""

from __future__ import annotations

from collections.abc import Callable

from objckpt.dcp.local_copy import LocalCopy
from objckpt.dcp.read_plan import Range
from objckpt.errors import SizeMismatchError
from objckpt.format.ref_check import stored_where
from objckpt.options import ReadOptions
from objckpt.writers.base import ObjectStore
from objckpt.writers.location import Location
from objckpt.writers.translate import translate

__all__ = ["fetch_ranges"]


def fetch_ranges(
    batch: list[Range],
    location: Location,
    store: Callable[[], ObjectStore],
    local: LocalCopy | None,
    options: ReadOptions,
) -> list[bytes]:
    """Every range of a batch, in order: from the local copy what it holds intact
    (those ranges marked verified when ``options.verify``), the rest from the store.

    Raises:
        SizeMismatchError: An object is missing from the store or shorter than planned.
        StoreError: The store failed.
    """
    if local is None:
        return _fetch_remote(batch, location, store, options)
    out: list[bytes | None] = [None] * len(batch)
    for n, rng in enumerate(batch):
        if local.holds(rng.key):
            out[n] = local.read_span(rng.key, rng.start, rng.end, rng.stored(), options.verify)
            if out[n] is not None:
                rng.verified = options.verify
    remote = [n for n, data in enumerate(out) if data is None]
    if remote:
        fetched = _fetch_remote([batch[n] for n in remote], location, store, options)
        for n, data in zip(remote, fetched, strict=True):
            out[n] = data
    return [d for d in out if d is not None]


def _fetch_remote(
    batch: list[Range],
    location: Location,
    store: Callable[[], ObjectStore],
    options: ReadOptions,
) -> list[bytes]:
    """Fetch every range of a batch concurrently; big ranges in parallel pieces."""
    keys, starts, ends, owner = [], [], [], []
    step = options.range_size
    for n, rng in enumerate(batch):
        for start in range(rng.start, rng.end, step) if rng.end > rng.start else [rng.start]:
            keys.append(rng.key)
            starts.append(start)
            ends.append(min(start + step, rng.end))
            owner.append(n)
    # One retry layer: each request retries itself (body included) on S3 and GCS;
    # other stores get the whole batch retried.
    return store().retrying(
        lambda: _fetch_once(batch, location, store(), keys, starts, ends, owner),
        f"reading {len(keys)} ranges of {location.url}",
    )


def _fetch_once(
    batch: list[Range],
    location: Location,
    store: ObjectStore,
    keys: list[str],
    starts: list[int],
    ends: list[int],
    owner: list[int],
) -> list[bytes]:
    try:
        pieces = store.read_ranges(keys, starts, ends)
    except Exception as exc:
        raise translate(exc, url=location.url, action="reading") from exc
    out: list[list[bytes]] = [[] for _ in batch]
    for n, piece, start, end in zip(owner, pieces, starts, ends, strict=True):
        if isinstance(piece, BaseException):
            url = location.url_of(batch[n].key)
            if isinstance(piece, FileNotFoundError):
                raise SizeMismatchError(
                    f"{url} is missing{stored_where(location, batch[n].key)}, but the "
                    f"manifest of {location.url} lists it"
                ) from piece
            raise translate(piece, url=url, action="reading") from piece
        if len(piece) != end - start:
            raise SizeMismatchError(
                f"{location.url_of(batch[n].key)}{stored_where(location, batch[n].key)} is "
                f"shorter than the manifest says (bytes {start}-{end} requested, "
                f"{len(piece)} returned)"
            )
        out[n].append(piece)
    return [p[0] if len(p) == 1 else b"".join(p) for p in out]
