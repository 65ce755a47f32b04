"""The bytes of planned ranges: from the local copy where it holds them intact, else the store.

Each range is read into the memory its :class:`~objckpt.writers.reads.SpanSink`
lays out (scratch, and tensors' own memory where their bytes fall: see
:mod:`objckpt.dcp.delivery`). Store reads go through
:meth:`~objckpt.writers.base.ObjectStore.read_ranges_into`, all ranges of a batch
at once (a range past an object's end reads as empty, whatever the store
answers), and a range larger than ``ReadOptions.range_size`` is split into pieces
fetched in parallel (:func:`pieces_of`: the last may be up to a quarter larger).
A response cut off mid-body is retried as its own request by the store's retry
layer (a store without one gets its batch retried whole). A piece missing or
shorter than the manifest says is a :class:`SizeMismatchError` naming the object
(and, for bytes the step reuses from an earlier step, both steps): the manifest
lists it, so the store lost it.
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
from objckpt.writers.reads import SpanSink
from objckpt.writers.translate import translate

__all__ = ["fetch_ranges"]


def fetch_ranges(
    batch: list[Range],
    sinks: list[SpanSink],
    location: Location,
    store: Callable[[], ObjectStore],
    local: LocalCopy | None,
    options: ReadOptions,
) -> None:
    """Every range of a batch into its sink: from the local copy what it holds intact
    (those ranges marked verified when ``options.verify``), the rest from the store.

    Raises:
        SizeMismatchError: An object is missing from the store or shorter than planned.
        StoreError: The store failed.
    """
    remote = []
    for n, rng in enumerate(batch):
        if local is not None and local.holds(rng.key):
            data = local.read_span(rng.key, rng.start, rng.end, rng.stored(), options.verify)
            if data is not None:
                sinks[n].write(0, data)
                rng.verified = options.verify
                continue
        remote.append(n)
    if remote:
        _fetch_remote(
            [batch[n] for n in remote], [sinks[n] for n in remote], location, store, options
        )


def pieces_of(start: int, end: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` in ranged GETs of ``step`` bytes, but for the last: a tail of
    at most a quarter of ``step`` is read with the piece before it. A tensor is its frame and
    its bytes, so one of 16 MiB spans 16 MiB and ~1.5 KiB; cut at 16 MiB, each such
    tensor cost a second request for those few KiB, whose fixed cost buys no
    parallelism (#47)."""
    pieces = []
    while end - start > step + step // 4:
        pieces.append((start, start + step))
        start += step
    pieces.append((start, end))
    return pieces


def _fetch_remote(
    batch: list[Range],
    sinks: list[SpanSink],
    location: Location,
    store: Callable[[], ObjectStore],
    options: ReadOptions,
) -> None:
    """Fetch every range of a batch concurrently; big ranges in parallel pieces."""
    keys, starts, ends, owner, pieces = [], [], [], [], []
    for n, rng in enumerate(batch):
        for start, end in pieces_of(rng.start, rng.end, options.range_size):
            keys.append(rng.key)
            starts.append(start)
            ends.append(end)
            owner.append(n)
            pieces.append(sinks[n].window(start - rng.start, end - start))
    # One retry layer: each request retries itself (body included) on S3 and GCS, and
    # on Azure (whose SDK asks again for a chunk whose body was cut short); other
    # stores get the whole batch retried.
    store().retrying(
        lambda: _fetch_once(batch, location, store(), keys, starts, ends, owner, pieces),
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
    pieces: list[SpanSink],
) -> None:
    try:
        got = store.read_ranges_into(keys, starts, ends, pieces)
    except Exception as exc:
        raise translate(exc, url=location.url, action="reading") from exc
    for n, answer, start, end in zip(owner, got, starts, ends, strict=True):
        if isinstance(answer, BaseException):
            url = location.url_of(batch[n].key)
            if isinstance(answer, FileNotFoundError):
                raise SizeMismatchError(
                    f"{url} is missing{stored_where(location, batch[n].key)}, but the "
                    f"manifest of {location.url} lists it"
                ) from answer
            raise translate(answer, url=url, action="reading") from answer
        if answer != end - start:
            raise SizeMismatchError(
                f"{location.url_of(batch[n].key)}{stored_where(location, batch[n].key)} is "
                f"{'shorter' if answer < end - start else 'longer'} than the manifest says "
                f"(bytes {start}-{end} requested, {answer} returned)"
            )
