"""Tuning knobs, one small frozen value per concern.

Defaults were chosen by measurement against a moto server on a 2-core machine and
by the stores' documented limits (S3: parts of 5 MiB to 5 GiB, at most 10,000 per
upload). Validation happens on construction, so a bad value is reported where it
was written, not halfway through a save.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import cast

from objckpt._removed import ASYNC_OPTIONS, READ_OPTIONS, UPLOAD_OPTIONS, removed_keywords
from objckpt.errors import ConfigurationError

__all__ = ["AsyncOptions", "ReadOptions", "UploadOptions"]

MiB = 1024 * 1024
S3_MIN_PART = 5 * MiB
S3_MAX_PART = 5 * 1024 * MiB
#: S3's largest object in one PutObject; larger ones must go multipart.
S3_MAX_PUT = 5 * 1024 * MiB
#: An object whose size hint leaves a tail this short past its last full part gets
#: parts a little larger, so the tail is not a request of its own (part_size_for).
SHORT_TAIL = S3_MIN_PART
MAX_PARTS = 10_000


def _require(cond: bool, option: str, value: object, expected: str) -> None:
    if not cond:
        raise ConfigurationError(f"option {option}={value!r} is invalid: expected {expected}")


@removed_keywords(UPLOAD_OPTIONS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class UploadOptions:
    """How payload bytes are cut into objects and parts.

    Attributes:
        part_size: Bytes per multipart part. Objects up to twice this (and at most
            5 GiB, S3's largest PUT) go up in one request; larger ones as multipart
            uploads. Azure's blocks stop at its 4,000 MiB limit. Grown automatically so an
            object never needs more than 10,000 parts, and a little where an
            object of two or more parts would end in one under 5 MiB, so those
            bytes are not a request of their own (parts stay equal, the last no
            larger; two parts go up in one request).
        object_size: Target size of a payload object. Small tensors are packed
            together up to this many bytes of their own (their frames, a KiB or
            two each, not counted: four 16 MiB tensors fill a 64 MiB object); a
            tensor of half this or more gets an object of its own.
            Moderate objects keep ranged reads cheap and let uploads run in parallel.
        max_parts_in_flight: Parts (or small objects) uploading at once per writer; also
            bounds the memory held by part buffers to ``max_parts_in_flight * part_size``.
        prefix_entropy: Hex digits of hashed sub-prefix in front of each payload
            key (0 = off). S3 serves about 3,500 PUT/s per prefix: a save whose
            ranks write more than that per second at once (e.g. 512 ranks x 8 parts
            in flight, parts finishing every ~1 s = 4,096 PUT/s) can meet 503s on
            one prefix; 1 digit spreads them over 16 prefixes, 2 over 256.
        persistent_prefixes: With ``prefix_entropy``, put each payload's hashed
            prefix in front of the step directory (``<root>/spread-3f/step-<N>/…``)
            instead of inside it, so the prefixes are the same for every step and
            the partitions S3 split for earlier steps serve the next one; inside
            the step, every save starts again on a prefix that did not exist a
            minute earlier. Only for steps of a root (a ``CheckpointManager``
            without a local tier, or a ``<root>/step-<N>`` URL); stock DCP readers
            load such a step from a local filesystem only.
        deadline: Seconds one save's store requests may take in all, from the
            start of its uploads to the commit (None: no bound). A stalled endpoint
            then fails the save in bounded time, with an error naming the rank and
            the object, instead of after every part's retries in turn. Raise it
            for many GiB per rank over a slow link.
        preflight_timeout: Seconds allowed to confirm the bucket is reachable and
            writable before anything is written (within ``deadline``). A
            synchronous save's coordinator proves it for each save (other ranks
            would multiply its requests by the world size on every save; a rank
            that cannot write fails its first upload instead, and nothing is
            committed); an async checkpointer, every rank once per bucket, before
            its first copy, so bad credentials fail ``save()`` before any staging.
        compression: None (off: items stored as DCP's writers store them), or
            ``"zstd"`` (each item compressed with zstd, recorded under torch's own
            stream-transform descriptor, so stock readers load it) or
            ``"bytegroup+zstd"`` (floating-point tensors' bytes grouped into planes
            first: a better ratio; stock readers need ``objckpt.ByteGrouping``
            registered), each optionally ``":<level>"`` (zstd level 1-22, default
            3), e.g. ``"zstd:1"``. Needs ``pip install 'objckpt[compress]'``.
        stock_metadata_max_ranks: Largest world size whose saves write DCP's
            ``.metadata`` pickle, which stock DCP readers (``FileSystemReader``,
            ``FsspecReader``) need and objckpt's never read; ``None``: every save
            writes it. It holds every item of every rank: 153 MB at 1,024 ranks of
            a 1,200-tensor model and 1.2 GB at 8,192, built by rank 0's node
            (150 CPU-s at 8,192 for a plan's first save) and unpickled whole by
            every rank of a stock load. Above the limit the manifest records that
            the save wrote none (``Manifest.stock_metadata``), and
            :func:`objckpt.write_stock_metadata` (``objckpt stock-metadata``) writes
            it for a committed step when a stock reader needs it (#46).
    """

    part_size: int = 16 * MiB
    object_size: int = 64 * MiB
    max_parts_in_flight: int = 8
    prefix_entropy: int = 0
    persistent_prefixes: bool = False
    deadline: float | None = 600.0
    preflight_timeout: float = 30.0
    compression: str | None = None
    stock_metadata_max_ranks: int | None = 2048

    def __post_init__(self) -> None:
        from objckpt.format.compress import parse_compression

        parse_compression(self.compression)  # ConfigurationError naming the option
        _require(
            isinstance(self.part_size, int) and S3_MIN_PART <= self.part_size <= S3_MAX_PART,
            "part_size",
            self.part_size,
            "an int between 5 MiB and 5 GiB (S3's part limits)",
        )
        _require(
            isinstance(self.object_size, int) and self.object_size >= 1,
            "object_size",
            self.object_size,
            "a positive int (bytes)",
        )
        _require(
            isinstance(self.max_parts_in_flight, int) and 1 <= self.max_parts_in_flight <= 256,
            "max_parts_in_flight",
            self.max_parts_in_flight,
            "an int between 1 and 256",
        )
        _require(
            isinstance(self.prefix_entropy, int)
            and not isinstance(self.prefix_entropy, bool)
            and 0 <= self.prefix_entropy <= 8,
            "prefix_entropy",
            self.prefix_entropy,
            "an int between 0 (off) and 8 hex digits",
        )
        _require(
            isinstance(self.persistent_prefixes, bool),
            "persistent_prefixes",
            self.persistent_prefixes,
            "True or False",
        )
        _require(
            not self.persistent_prefixes or self.prefix_entropy > 0,
            "persistent_prefixes",
            self.persistent_prefixes,
            "False unless prefix_entropy is set (the digits of the prefixes it keeps)",
        )
        _require(
            self.deadline is None
            or (
                isinstance(self.deadline, (int, float))
                and not isinstance(self.deadline, bool)
                and self.deadline > 0
            ),
            "deadline",
            self.deadline,
            "seconds > 0, or None for no deadline",
        )
        _require(
            self.stock_metadata_max_ranks is None
            or (type(self.stock_metadata_max_ranks) is int and self.stock_metadata_max_ranks >= 0),
            "stock_metadata_max_ranks",
            self.stock_metadata_max_ranks,
            "an int >= 0 (0: no save writes .metadata), or None (every save does)",
        )
        _require(
            isinstance(self.preflight_timeout, (int, float))
            and not isinstance(self.preflight_timeout, bool)
            and self.preflight_timeout > 0,
            "preflight_timeout",
            self.preflight_timeout,
            "seconds > 0",
        )

    def writes_stock_metadata(self, world_size: int) -> bool:
        """Whether a save of ``world_size`` ranks writes ``.metadata``
        (``stock_metadata_max_ranks``): the one place the rule is written."""
        limit = self.stock_metadata_max_ranks
        return limit is None or world_size <= limit

    def part_size_for(self, size_hint: int) -> int:
        """The part size for an object of about ``size_hint`` bytes (<= 10,000 parts).

        A payload object is packed to ``object_size`` and its tensors' frames overflow
        a multiple of ``part_size`` by a little (four 16 MiB tensors make 64 MiB and
        6 KiB): cut at ``part_size``, it ends in a part of those few KiB, one more
        request per object (#47). Where the hint leaves a tail under ``SHORT_TAIL``
        past two or more full parts, the parts grow (to whole MiB, with a MiB to
        spare for the hint's estimate of the frames) so that as many parts cover
        the object. Every part but the last is still the same size and the last no
        larger, which S3-compatible stores that demand equal parts (Cloudflare R2)
        accept; a larger last part they refuse. Two full parts and a short tail
        grow into two parts, which an S3 upload sends as one PUT: one request where
        a Create, three parts and a Complete went (a tensor of exactly twice
        ``part_size``, a 4096x4096 bf16 matrix at the default, in an object of its own).
        """
        needed = -(-size_hint // (MAX_PARTS - 100))  # keep headroom for the estimate
        needed = -(-needed // MiB) * MiB
        part = min(max(self.part_size, needed), S3_MAX_PART)
        full, tail = divmod(size_hint, part)
        if full >= 2 and 0 < tail < SHORT_TAIL:
            grown = -(-(size_hint + MiB) // full)
            part = min(-(-grown // MiB) * MiB, S3_MAX_PART)
        return part


@removed_keywords(READ_OPTIONS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How payload bytes are fetched on load.

    Attributes:
        verify: Check every item's CRC32C against the manifest.
        range_size: Size of a ranged GET; bigger spans are split so they
            download in parallel. A span's last GET may be up to a quarter
            larger: a shorter tail is read with it, not as a request of its own.
        coalesce_gap: Ranges of one object closer than this are fetched as one.
        max_in_flight_bytes: Bytes fetched but not yet copied into tensors: half
            for the batch being copied, half for the next one being fetched (a
            batch holds at least one range, so it may exceed its half by that).
            Batches of 256 MiB fetch 16 ranges at once; at 128 MiB a 1 GiB load
            on moto took 4.1 s instead of 3.1 s.
        trust_pickles: Let non-tensor values be unpickled with full pickle (custom
            classes). Off: they are read with ``torch.load(weights_only=True)``,
            which admits plain values only, so a crafted checkpoint cannot run code.
        max_metadata_bytes: Largest manifest, index object or stock ``.metadata``
            the reader accepts, judged before it is fetched (from the size the
            manifest or the listing records, or by reading at most this many bytes
            plus one of the manifest), so a crafted one costs bounded memory. The
            default is far above what objckpt writes: bench/bench_scale.py's
            1,200-tensor model gives a 1.07 MB manifest and 58 KB index objects at
            4,096 ranks (about 1.8 MB and the same 58 KB at 8,192). Older format-1
            manifests pass it at about 900 ranks (290 MB at 1,024) and stock
            ``.metadata`` pickles at about 1,400 (195 MB at 1,024): raise it to
            read those.
        broadcast: Coordinate the reads of the reader's process group: read the
            manifest once, on rank 0, and send its bytes to the other ranks (it
            grows with W: W ranks each reading it is W^2 bytes per job), and fetch
            each stored item several ranks read (replicated tensors) once, on one
            of them, which broadcasts it to the others
            (:mod:`~objckpt.dcp.shared_reads`). ``None`` (default): so in a process
            group, the manifest as a collective in the reader's first
            ``read_metadata()`` of each load (``dcp.load`` calls it on every rank);
            outside one, read when built. ``True``: the reader's constructor is the
            manifest's collective. ``False``: every rank reads everything itself,
            as where one rank loads alone in a job (``dcp.load(..., no_dist=True)``,
            ``read_metadata()`` on some ranks).
        allow_stock: Load a stock DCP checkpoint (``.metadata``, no manifest) when
            that is what the URL holds. False: only committed objckpt checkpoints
            (the manager's rule: a step exists only once committed).
        local: A local directory holding (some of) the checkpoint's objects under
            the same names: read first, object by object, checked, with the URL for
            whatever it lacks or holds damaged. Its manifest, when present and
            readable, is used without asking the store. A sequence of directories:
            each looked in, in order (a local tier's step directory, then its
            replicas of other nodes' files). Kept as a tuple of paths (None: none).

    ``CheckpointManager.load`` decides ``broadcast``, ``allow_stock`` and ``local``
    itself (its process group, committed steps only, its local tier) and refuses a
    ``read`` that sets them.
    """

    verify: bool = True
    range_size: int = 16 * MiB
    coalesce_gap: int = 1 * MiB
    max_in_flight_bytes: int = 512 * MiB
    trust_pickles: bool = False
    max_metadata_bytes: int = 256 * MiB
    broadcast: bool | None = None
    allow_stock: bool = True
    local: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.verify, bool), "verify", self.verify, "True or False")
        _require(
            self.broadcast is None or isinstance(self.broadcast, bool),
            "broadcast",
            self.broadcast,
            "True, False or None (coordinate in a process group)",
        )
        _require(
            isinstance(self.allow_stock, bool), "allow_stock", self.allow_stock, "True or False"
        )
        if self.local is not None:
            dirs = [self.local] if isinstance(self.local, (str, os.PathLike)) else self.local
            _require(
                isinstance(dirs, Sequence) and all(isinstance(d, (str, os.PathLike)) for d in dirs),
                "local",
                self.local,
                "a directory, or a sequence of directories",
            )
            # One hashable value, however it was spelt: the paths as strings, in order.
            object.__setattr__(self, "local", tuple(os.fspath(d) for d in dirs) or None)
        _require(
            type(self.max_metadata_bytes) is int and self.max_metadata_bytes >= 1,
            "max_metadata_bytes",
            self.max_metadata_bytes,
            "a positive int (bytes)",
        )
        _require(
            isinstance(self.trust_pickles, bool),
            "trust_pickles",
            self.trust_pickles,
            "True or False",
        )
        _require(
            isinstance(self.range_size, int) and self.range_size >= 64 * 1024,
            "range_size",
            self.range_size,
            "an int >= 64 KiB",
        )
        _require(
            isinstance(self.coalesce_gap, int) and self.coalesce_gap >= 0,
            "coalesce_gap",
            self.coalesce_gap,
            "an int >= 0",
        )
        _require(
            isinstance(self.max_in_flight_bytes, int)
            and self.max_in_flight_bytes >= self.range_size,
            "max_in_flight_bytes",
            self.max_in_flight_bytes,
            "an int >= range_size",
        )

    @property
    def local_dirs(self) -> tuple[str, ...]:
        """``local`` as the paths it is kept as, in order (empty: none)."""
        return cast("tuple[str, ...]", self.local or ())


@removed_keywords(ASYNC_OPTIONS)
@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncOptions:
    """How async saves run.

    Attributes:
        workers: Upload processes per rank. They share ``UploadOptions.max_parts_in_flight``
            (each gets its share, rounded up), so the rank's requests and part
            buffers in flight stay what one synchronous writer would hold. Each
            process costs ~50 MiB (an interpreter with the store's client stack).
        uploads_per_worker: Objects each worker uploads at once, on threads of its
            own. They share the worker's parts in flight, so one worker keeps its
            whole share busy even when each object has fewer parts than that.
        max_saves_in_flight: Saves that may be uploading at once; a further ``save``
            waits for the oldest to finish (each in-flight save holds its own staging).
        barrier_timeout: Seconds the commit waits for every rank's uploads (and
            other ranks wait for the commit) before failing with an error naming
            the missing ranks.
        staging_budget: Bytes of staging memory one save may hold (None: as much
            as the state dict). A larger state dict is staged in waves: ``save``
            copies a budget's worth, hands it to the workers, waits for those
            uploads, and goes on, returning once every tensor is copied. The stall
            then includes the upload of all but the last wave. A wave always holds
            the largest tensor, even above the budget.
        share_replicated: In a process group, cut replicated tensors of at least
            two parts (``UploadOptions.part_size``) into row slices that the
            replicas upload a share each (DCP alone writes each one whole, from one
            rank). Off: each replicated tensor goes up whole from one rank.
        background_staging: Return from ``save`` before the tensors are copied to
            staging memory: the copy runs on the save's background thread, and the
            caller must not change the tensors in place until
            ``SaveHandle.wait_staged()`` returns (call it just before
            ``optimizer.step()``: forward and backward only read the weights, so
            the copy overlaps them). A tensor changed earlier is caught by its
            version counter and fails that save (nothing is committed). The first
            save of a state-dict structure, and saves in waves, copy in the call.
            Off: ``save`` returns once the copy is done (the stall is the copy).
        staging_threads: Threads the copy into staging memory may use (capped at
            the CPUs the process may run on). One thread copies host memory at
            about half the rate two do, and torch copies in parallel only inside
            one tensor and only on its intra-op threads; the copy is cut into
            pieces of equal bytes instead. CUDA tensors are copied on one stream.
        staging_dir: The directory staging memory lives in (None: ``/dev/shm``
            where the system has it, else the temporary directory). Staging
            reserves its bytes there before copying; where the whole state dict
            does not fit, ``save`` copies in waves (as with ``staging_budget``)
            and where not even a wave fits the save fails with
            ``StagingSpaceError``. Containers give ``/dev/shm`` 64 MiB unless
            told otherwise (``docker run --shm-size``, a Kubernetes ``emptyDir``
            with ``medium: Memory``); a directory on another tmpfs or a local
            disk works too (a disk is slower, and the page cache holds the bytes).
        exit_timeout: Seconds the interpreter's exit waits for saves still in
            flight (a script that ended without ``wait_until_finished``), after
            warning which; a save not done by then is dropped, uncommitted, with a
            second warning. 0: warn only. Bounded so that exit never hangs on a
            stuck store; long enough for a save whose uploads were nearly done.
    """

    workers: int = 1
    uploads_per_worker: int = 2
    max_saves_in_flight: int = 1
    barrier_timeout: float = 600.0
    staging_budget: int | None = None
    share_replicated: bool = True
    background_staging: bool = False
    staging_threads: int = 4
    staging_dir: str | None = None
    exit_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.staging_dir is not None:
            _require(
                isinstance(self.staging_dir, str), "staging_dir", self.staging_dir, "a str path"
            )
            _require(
                os.path.isdir(self.staging_dir),
                "staging_dir",
                self.staging_dir,
                "an existing directory",
            )
            _require(
                os.access(self.staging_dir, os.W_OK | os.X_OK),
                "staging_dir",
                self.staging_dir,
                "a directory this process may create files in",
            )
        if not isinstance(self.background_staging, bool):
            raise ConfigurationError(
                f"option background_staging={self.background_staging!r} is invalid: "
                "expected True or False"
            )
        for name in ("workers", "uploads_per_worker", "staging_threads"):
            count = getattr(self, name)
            _require(
                isinstance(count, int) and not isinstance(count, bool) and count >= 1,
                name,
                count,
                "an int >= 1",
            )
        if not isinstance(self.max_saves_in_flight, int) or self.max_saves_in_flight < 1:
            raise ConfigurationError(
                f"option max_saves_in_flight={self.max_saves_in_flight!r} is invalid: "
                "expected an int >= 1"
            )
        if self.staging_budget is not None and (
            not isinstance(self.staging_budget, int)
            or isinstance(self.staging_budget, bool)
            or self.staging_budget < 1
        ):
            raise ConfigurationError(
                f"option staging_budget={self.staging_budget!r} is invalid: "
                "expected a number of bytes >= 1, or None"
            )
        if not isinstance(self.share_replicated, bool):
            raise ConfigurationError(
                f"option share_replicated={self.share_replicated!r} is invalid: "
                "expected True or False"
            )
        if not (isinstance(self.barrier_timeout, (int, float)) and self.barrier_timeout > 0):
            raise ConfigurationError(
                f"option barrier_timeout={self.barrier_timeout!r} must be a positive number"
            )
        _require(
            isinstance(self.exit_timeout, (int, float))
            and not isinstance(self.exit_timeout, bool)
            and self.exit_timeout >= 0,
            "exit_timeout",
            self.exit_timeout,
            "seconds >= 0 (0: warn only)",
        )
