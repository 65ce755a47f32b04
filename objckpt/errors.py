"""objckpt's one error hierarchy.

Every error objckpt raises on purpose is an :class:`ObjckptError`. The classes that
mean "not there" also subclass :class:`FileNotFoundError` and the ones that mean
"already committed" subclass :class:`FileExistsError`, so code written against the
standard library's meanings keeps working. Backend errors (botocore, aiohttp, OS)
are translated at the store boundary and kept as ``__cause__``.

Messages name the URL or object and what was expected, and never contain
credentials or ``storage_options`` values: torch's checkpoint logger prints
exception text at ERROR level, so an error message is as public as a log line.

::

    ObjckptError
    ├── ConfigurationError (ValueError)       bad option, URL or protocol
    ├── StagingSpaceError (OSError)           no room for staging memory (a full /dev/shm)
    ├── StateDictError (TypeError)            a state-dict entry that cannot be saved
    │   └── StateDictMismatchError (ValueError) load target's shapes differ from the step
    ├── StoreError (OSError)                  the store refused or failed a request
    │   ├── StoreUnreachableError (ConnectionError)
    │   │   └── RequestDeadlineError          no answer within RetryPolicy.request_deadline
    │   ├── StoreRefusedError                 the same error answered until retries ran out
    │   ├── AccessDeniedError (PermissionError)
    │   │   └── MissingCredentialsError
    │   ├── BucketNotFoundError (FileNotFoundError)
    │   └── UploadError                       an object could not be written (upload aborted)
    │       └── SaveDeadlineError             not done within UploadOptions.deadline
    ├── CheckpointNotFoundError (FileNotFoundError)
    │   └── CheckpointNotCommittedError       payload present, no manifest
    ├── CheckpointExistsError (FileExistsError)
    ├── ManifestError (ValueError)            manifest unreadable, malformed or too new
    │   └── SafetensorsError                  a safetensors file or index to import is malformed
    ├── IntegrityError                        bytes on the store do not match the manifest
    │   ├── ChecksumMismatchError
    │   └── SizeMismatchError
    ├── BackupError                           a backup target is not up to date
    ├── BarrierTimeoutError (TimeoutError)    ranks did not report in time (async commit)
    ├── RequestFailedError                    an async request failed on some rank
    ├── PeerRankError                         another rank failed this save or load
    ├── PeerWireError (RuntimeError)          a peer sent what objckpt never sends (pair broken)
    ├── LinkRefusedError (OSError)            a symbolic link under the local tier's root
    ├── SaveSequenceError                     ranks called save() a different number of times
    ├── StepOrderError (ValueError)           a save below the newest step of the run (a rollback)
    └── InternalError (RuntimeError)          a bug in objckpt: a call out of its order
"""

from __future__ import annotations

import errno

__all__ = [
    "AccessDeniedError",
    "BackupError",
    "BarrierTimeoutError",
    "BucketNotFoundError",
    "CheckpointExistsError",
    "CheckpointNotCommittedError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "ConfigurationError",
    "IntegrityError",
    "InternalError",
    "LinkRefusedError",
    "ManifestError",
    "MissingCredentialsError",
    "ObjckptError",
    "PeerRankError",
    "PeerWireError",
    "RequestDeadlineError",
    "RequestFailedError",
    "SafetensorsError",
    "SaveDeadlineError",
    "SaveSequenceError",
    "SizeMismatchError",
    "StagingSpaceError",
    "StateDictError",
    "StateDictMismatchError",
    "StepOrderError",
    "StoreError",
    "StoreRefusedError",
    "StoreUnreachableError",
    "UploadError",
]


class ObjckptError(Exception):
    """Base of every error objckpt raises on purpose."""


class ConfigurationError(ObjckptError, ValueError):
    """An option, URL or protocol the caller gave cannot work."""


class StagingSpaceError(ObjckptError, OSError):
    """Staging memory could not get room: the directory it lives in is too full.

    Containers give ``/dev/shm`` 64 MiB unless told otherwise; staging reserves its
    bytes before copying, so a full directory is this error on the rank that met it
    (and its refusal in the save's agreement) instead of a SIGBUS mid-copy. An
    ``OSError`` with ``errno.ENOSPC``, as the reservation's own failure would be.

    Attributes:
        needed: Bytes the reservation asked for.
        free: Bytes free in ``directory`` when it failed.
        directory: Where staging lives (``AsyncOptions.staging_dir``).
    """

    def __init__(self, message: str, needed: int = 0, free: int = 0, directory: str = "") -> None:
        super().__init__(message)
        self.errno = errno.ENOSPC
        self.needed = needed
        self.free = free
        self.directory = directory

    def __reduce__(self) -> tuple[type[StagingSpaceError], tuple[str, int, int, str]]:
        return (type(self), (str(self), self.needed, self.free, self.directory))


class StateDictError(ObjckptError, TypeError):
    """A state-dict entry cannot be serialized into a checkpoint."""


class StateDictMismatchError(StateDictError, ValueError):
    """The state dict to load into does not fit the checkpoint (a shape differs).

    A ValueError too, as torch's planner raises for the same cause, so existing
    handlers keep working; the message adds the checkpoint URL to torch's."""


class StoreError(ObjckptError, OSError):
    """The object store refused or failed a request."""


class StoreUnreachableError(StoreError, ConnectionError):
    """The store's endpoint could not be reached in the allotted time."""


class RequestDeadlineError(StoreUnreachableError):
    """A store request and its retries got no answer within
    ``RetryPolicy.request_deadline`` (reads, listings and deletes, which no save's
    deadline bounds): a silent endpoint fails in that time instead of after every
    attempt's own timeout in turn."""


class StoreRefusedError(StoreError):
    """The store answered a request with an error worth retrying (500, 503 SlowDown)
    on every attempt until the retries ran out (``RetryPolicy.attempts``,
    ``give_up_after`` or ``request_deadline``). The message says what it answered,
    how many times and for how long: a refusal that persists is not an outage to
    wait out until the save's deadline."""


class AccessDeniedError(StoreError, PermissionError):
    """The store answered, but refused the credentials for this operation."""


class MissingCredentialsError(AccessDeniedError):
    """No credentials were found for a store that needs them."""


class BucketNotFoundError(StoreError, FileNotFoundError):
    """The bucket (or local root directory) named by the URL does not exist."""


class UploadError(StoreError):
    """An object could not be written; any multipart upload was aborted."""


class SaveDeadlineError(UploadError):
    """A save's requests were not all answered within ``UploadOptions.deadline``."""


class CheckpointNotFoundError(ObjckptError, FileNotFoundError):
    """Nothing that looks like a checkpoint exists at the URL."""


class CheckpointNotCommittedError(CheckpointNotFoundError):
    """Payload objects exist at the URL, but no manifest commits them."""


class CheckpointExistsError(ObjckptError, FileExistsError):
    """A committed checkpoint already exists where a new one was to be written."""


class ManifestError(ObjckptError, ValueError):
    """The manifest is not JSON, fails validation, or is from a newer format."""


class SafetensorsError(ManifestError):
    """A safetensors file or index that ``import`` reads is malformed: a header, a
    byte range, a dtype or a shard name the format does not allow. The message names
    the file (and the tensor or shard at fault); nothing is written at the destination.
    A :class:`ManifestError` too: stored metadata refused, as a crafted manifest is."""


class IntegrityError(ObjckptError):
    """Bytes on the store differ from what the manifest recorded."""


class ChecksumMismatchError(IntegrityError):
    """An object's CRC32C differs from the manifest's."""


class SizeMismatchError(IntegrityError):
    """An object is shorter or longer than the manifest says."""


class BackupError(ObjckptError):
    """A backup target could not be brought up to date (the primary is unaffected)."""


class BarrierTimeoutError(ObjckptError, TimeoutError):
    """Some ranks did not report within the barrier timeout (a rank died or hung)."""


class PeerSilentError(BarrierTimeoutError):
    """A peer rank did not answer a point-to-point exchange in time (dead or stuck).

    The message names that rank: the one this rank waited on, not merely the one
    it talks to.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        #: The (group) rank that did not answer.
        self.rank = rank

    def __reduce__(self) -> tuple[type[PeerSilentError], tuple[str, int | None]]:
        return (type(self), (str(self), self.rank))


class RequestFailedError(ObjckptError):
    """An async request's work failed on some rank, so no rank finalizes it as a success."""


class PeerRankError(ObjckptError):
    """Another rank of the group failed this save or load; its error is in the text.

    Raised on every rank but the failing one (which raises its own error), so every
    rank of a job ends a collective operation with the same outcome.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        #: The (group) rank whose error this is, when known.
        self.rank = rank

    def __reduce__(self) -> tuple[type[PeerRankError], tuple[str, int | None]]:
        return (type(self), (str(self), self.rank))


class PeerWireError(ObjckptError, RuntimeError):
    """A peer node's rank sent what objckpt never sends (a header of a length or
    listing file sizes outside the wire's bounds): what follows it cannot be read in
    step, so the pair is broken, as if the peer were dead (a ``RuntimeError``, as
    torch's own error for a peer that stops answering is)."""


class LinkRefusedError(ObjckptError, OSError):
    """A symbolic link sits where the local tier reads, lists, writes or deletes (a
    directory or a file's name under the tier's root): objckpt never goes through
    one, since what it leads to is not the tier's own. The message names the link
    and its target."""


class SaveSequenceError(ObjckptError):
    """Ranks reached a save's agreement in different saves (one rank skipped or
    repeated a ``save()`` call): refused on every rank instead of pairing them."""

    def __init__(self, message: str, highest: int = 0) -> None:
        super().__init__(message)
        #: The highest save number any rank brought: every rank continues from it,
        #: so the next save (made by every rank) agrees again.
        self.highest = highest

    def __reduce__(self) -> tuple[type[SaveSequenceError], tuple[str, int]]:
        return (type(self), (str(self), self.highest))


class StepOrderError(ObjckptError, ValueError):
    """A manager's save of a step below the newest step of the run, refused before
    anything is written: retention ranks steps by number and a restart resumes from
    the newest, so the lower step would be deleted or ignored. The message names both
    steps and ``CheckpointManager.discard_after``, the explicit way to roll back."""


class InternalError(ObjckptError, RuntimeError):
    """objckpt broke one of its own invariants (a step called out of its order, a
    state one of its own objects cannot be in): a bug to report, never the caller's
    input or the store's answer.

    One type for every such check, so a caller (or a test) tells a bug apart from
    every failure it can act on; a ``RuntimeError`` too, as an assertion that
    survives ``python -O`` would be. The message starts with ``internal:``.
    """
