"""The one door through which objckpt reaches a file on a node's local tier.

A tier's directory is a place users and other tools reach too, so what sits under
it is untrusted, as bucket contents are. Every module that reads, lists, writes or
deletes a file of the tier (its own steps, the replicas other nodes sent, the
reader's local copy, the start-up sweep) does it here, so the two rules below are
proven once and hold for every caller (``tests/api/test_node_door.py`` fails if a
module under ``objckpt/ops/`` or ``objckpt/dcp/`` opens a file itself):

* **No link is followed.** A link anywhere under the tier's root (at
  ``replicas/``, at a step's directory, at an entropy sub-directory or at the file's
  own name) leads to a directory that is not the tier's own, and objckpt cannot tell
  whose it is: writing there clobbers someone's files, deleting there removes them,
  and reading there loads a step the tier never held. Every component under the root
  is checked with ``lstat`` and opened with ``O_NOFOLLOW`` relative to its parent's
  descriptor, so a link is refused even when it appears between the check and the
  access, and the refusal names it (:class:`~objckpt.errors.LinkRefusedError`).
  Removal unlinks a link itself, never its target. The root itself may be a link:
  it is what the user configured.
* **A half-written file under its final name.** Bytes go to a temporary name in the
  destination directory (``.<name>.<32 hex>.tmp``, the name the tier's start-up sweep
  knows as a crash leftover), the file is fsynced, renamed into place, and the
  directory fsynced, so a file under its name is whole and survives a power loss.
  Any failure, or leaving the write without committing it, removes the temporary
  file: a failed transfer leaves nothing behind.

Directories are made component by component, each checked the same way. The store
sits in the store layer, beside :class:`~objckpt.writers.local.LocalStore` (which
commits checkpoints at ``file://`` URLs, the local tier's saves among them), so the
reader's local copy (:mod:`objckpt.dcp.local_copy`) reaches the tier through it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import stat
import uuid
from types import TracebackType
from typing import Literal

from objckpt.errors import LinkRefusedError, ManifestError, ObjckptError

__all__ = ["REPLICAS_DIR", "Entry", "NodeStore", "PendingFile", "tier_store"]

logger = logging.getLogger(__name__)

#: The directory under a tier's path that holds other nodes' files.
REPLICAS_DIR = "replicas"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO under a file's name must not block the open (it is refused).
_READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _parts(rel: str) -> list[str]:
    """The components of a path relative to the root, refused unless every one is a
    plain name (no empty, ``.`` or ``..`` component, not absolute)."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ObjckptError(f"refusing {rel!r} on the local tier: not a plain relative path")
    return parts


def tier_store(directory: str) -> tuple[NodeStore, str]:
    """The store a directory of a tier is reached through, and its path under the
    store's root: a replica directory ``<tier>/replicas/<name>`` from the tier (so a
    link at ``replicas/`` is refused too), any other (a step's own directory) from
    its parent, the tier."""
    parent, name = os.path.split(os.path.normpath(directory))
    tier, replicas = os.path.split(parent)
    if replicas == REPLICAS_DIR:
        return NodeStore(tier), f"{REPLICAS_DIR}/{name}"
    return NodeStore(parent), name


@dataclasses.dataclass(frozen=True)
class Entry:
    """One name in a directory of the tier, as ``lstat`` sees it (never followed).

    Attributes:
        name: The name in its directory.
        kind: ``file`` (a regular file), ``dir``, ``link`` or ``other``.
        size: A file's size in bytes (0 for anything else).
        target: Where a link points (``?`` when unreadable); empty for anything else.
    """

    name: str
    kind: Literal["file", "dir", "link", "other"]
    size: int = 0
    target: str = ""


def _is_link(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in ``dir_fd`` is a symbolic link now (False if it is gone)."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _link_target(dir_fd: int, name: str) -> str:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return "?"


@dataclasses.dataclass(frozen=True)
class NodeStore:
    """Reads, lists, writes and removes under one tier root, never through a link;
    each file written whole or not at all.

    Every method takes a path relative to the root (``step-<N>/<key>``), each of its
    components a plain name; ``""`` names the root itself where a directory is meant.

    Args:
        root: The tier's directory (made by a write when missing; it may itself be a
            link).
    """

    root: str

    def _refuse(self, dir_fd: int, parts: list[str], name: str) -> LinkRefusedError:
        path = os.path.join(self.root, *parts, name)
        return LinkRefusedError(
            f"{path} is a symbolic link to {_link_target(dir_fd, name)}; objckpt never "
            "follows a link on the local tier: it neither reads, lists, writes nor deletes "
            "through one (remove it, or move the directory back)"
        )

    def _open_dir(self, parts: list[str], create: bool) -> int:
        """A descriptor of ``root/parts...``, each component checked (and made, with
        ``create``) without following a link. The root is made when missing (a
        replaced node's tier starts empty): it is the path the user configured. Each
        directory ``mkdir`` makes here is fsynced into its parent, so that a file
        committed into it is found by its path after a power loss (one made by
        another process at the same moment is that process's to make durable; the
        root's own parents are the user's)."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for i, part in enumerate(parts):
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                    else:
                        os.fsync(fd)
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise self._refuse(fd, parts[:i], part)
                try:
                    inner = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    # Became a link after the check: Linux answers a link opened with
                    # O_DIRECTORY | O_NOFOLLOW with ENOTDIR, others with ELOOP.
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(fd, part):
                        raise self._refuse(fd, parts[:i], part) from exc
                    raise
                os.close(fd)
                fd = inner
        except BaseException:
            os.close(fd)
            raise
        return fd

    def create(self, rel: str) -> PendingFile:
        """A new file that becomes ``root/rel`` when committed (directories made).

        Raises:
            LinkRefusedError: A component under the root, or ``rel`` itself, is a link.
            ObjckptError: ``rel`` is not a plain relative path.
            OSError: The disk refused.
        """
        parts = _parts(rel)
        dir_fd = self._open_dir(parts[:-1], create=True)
        try:
            name = parts[-1]
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                    raise self._refuse(dir_fd, parts[:-1], name)
            tmp = f".{name}.{uuid.uuid4().hex}.tmp"
            fd = os.open(tmp, _NEW_FILE, 0o666, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        return PendingFile(self, parts, tmp, fd)

    def write_bytes(self, rel: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        """Write ``data`` as ``root/rel``, whole or not at all.

        Raises:
            FileExistsError: ``create_only`` and ``root/rel`` exists (left as it is).
        """
        with self.create(rel) as f:
            f.write(data)
            f.commit(create_only=create_only)

    # -- reads, listings and removals: the same check of every component -------------------
    def _parent(self, rel: str) -> tuple[int, list[str], str]:
        """A descriptor of ``rel``'s directory (every component checked, nothing
        made), that directory's components and ``rel``'s last name."""
        parts = _parts(rel)
        return self._open_dir(parts[:-1], create=False), parts[:-1], parts[-1]

    def stat(self, rel: str) -> os.stat_result:
        """``root/rel``'s own status (``lstat``), every component checked.

        Raises:
            FileNotFoundError: Nothing has the name (or a directory above it is gone).
            LinkRefusedError: ``rel`` or a component above it is a link.
        """
        dir_fd, parents, name = self._parent(rel)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise self._refuse(dir_fd, parents, name)
            return st
        finally:
            os.close(dir_fd)

    def exists(self, rel: str) -> bool:
        """Whether anything has the name ``root/rel``: a link there, or above it, counts
        (it is there, and refused by whatever uses it); a look the disk refuses says
        no, as ``os.path.lexists`` does."""
        try:
            self.stat(rel)
        except LinkRefusedError:
            return True
        except (OSError, ObjckptError):
            return False
        return True

    def open_read(self, rel: str) -> io.BufferedReader:
        """The regular file ``root/rel`` opened for reading, reached without following
        a link (``O_NOFOLLOW`` at the file too, so a link swapped in after any check
        is refused, not read: its bytes are not the tier's).

        Raises:
            FileNotFoundError: Nothing has the name.
            LinkRefusedError: ``rel`` or a component above it is a link.
            OSError: It is not a regular file, or the disk refused.
        """
        dir_fd, parents, name = self._parent(rel)
        try:
            try:
                fd = os.open(name, _READ_FILE, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._refuse(dir_fd, parents, name) from exc
                raise
        finally:
            os.close(dir_fd)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                path = os.path.join(self.root, rel)
                code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
                raise OSError(code, "not a regular file", path)
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read_bytes(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """The whole of ``root/rel`` (see :meth:`open_read`); with ``max_bytes``, a
        larger file is refused before it is read (metadata read from the tier is
        untrusted input, bounded like bucket metadata).

        Raises:
            ManifestError: The file is larger than ``max_bytes``.
        """
        with self.open_read(rel) as f:
            if max_bytes is None:
                return f.read()
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:
            path = os.path.join(self.root, rel)
            raise ManifestError(f"{path} is larger than {max_bytes} bytes")
        return data

    def entries(self, rel: str = "") -> list[Entry]:
        """The names in the directory ``root/rel`` (``""``: the root), sorted, each as
        ``lstat`` sees it (a link is listed as a link, never followed; a name removed
        while the directory is listed is left out alone).

        Raises:
            FileNotFoundError: The directory is gone.
            LinkRefusedError: The directory or a component above it is a link.
        """
        parts = _parts(rel) if rel else []
        dir_fd = self._open_dir(parts, create=False)
        found: list[Entry] = []
        try:
            for name in sorted(os.listdir(dir_fd)):
                try:
                    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(mode.st_mode):
                    found.append(Entry(name, "link", target=_link_target(dir_fd, name)))
                elif stat.S_ISDIR(mode.st_mode):
                    found.append(Entry(name, "dir"))
                elif stat.S_ISREG(mode.st_mode):
                    found.append(Entry(name, "file", mode.st_size))
                else:
                    found.append(Entry(name, "other"))
        finally:
            os.close(dir_fd)
        return found

    def remove(self, rel: str) -> None:
        """Unlink ``root/rel`` (a link there is unlinked itself, never its target).

        Raises:
            FileNotFoundError: Nothing has the name.
            LinkRefusedError: A component above it is a link.
        """
        dir_fd, _, name = self._parent(rel)
        try:
            os.unlink(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def move_dir(self, rel: str, to: str) -> None:
        """Rename the directory ``root/rel`` to ``root/to`` (``to``'s parents made),
        never through a link, and make the move durable (both parents fsynced).

        Raises:
            FileNotFoundError: Nothing has the name ``rel``.
            FileExistsError: Something has the name ``to``.
            LinkRefusedError: ``rel``, or a component above either, is a link.
            OSError: ``rel`` is not a directory.
        """
        src_fd, parents, name = self._parent(rel)
        try:
            st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise self._refuse(src_fd, parents, name)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(f"{os.path.join(self.root, rel)} is not a directory")
            dst_parts = _parts(to)
            dst_fd = self._open_dir(dst_parts[:-1], create=True)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.stat(dst_parts[-1], dir_fd=dst_fd, follow_symlinks=False)
                    raise FileExistsError(f"{os.path.join(self.root, to)} exists")
                os.rename(name, dst_parts[-1], src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                os.fsync(dst_fd)
                os.fsync(src_fd)
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)

    def remove_dir(self, rel: str) -> None:
        """Remove the empty directory ``root/rel`` (a link there is refused by the
        system: ``rmdir`` never follows one).

        Raises:
            FileNotFoundError: Nothing has the name.
            LinkRefusedError: A component above it is a link.
            OSError: It is not empty, or not a directory.
        """
        dir_fd, _, name = self._parent(rel)
        try:
            os.rmdir(name, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    # -- the root as a whole -------------------------------------------------------------
    def identity(self) -> str:
        """Which directory the root is (device and inode), so two spellings of one
        directory, or a link to it, name the same tier.

        Raises:
            OSError: The root cannot be looked at.
        """
        st = os.stat(self.root)
        return f"{st.st_dev}:{st.st_ino}"

    def probe(self) -> int:
        """Make the root when missing, create and remove one file in it, and return
        the bytes free there: creating a file is the one test of "can this process
        write here" that read-only mounts, ACLs and root's immunity to modes all
        answer truthfully (``os.access`` does not).

        Raises:
            OSError: The root cannot be made or written, or its disk not looked at.
        """
        with self.create(f"objckpt-probe-{uuid.uuid4().hex}"):
            pass  # left uncommitted: its temporary file is removed
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize


class PendingFile:
    """A file being written under a temporary name; :meth:`commit` puts it in place,
    :meth:`discard` (or leaving a ``with`` block without committing) removes it.

    Only the file's own descriptor stays open while bytes arrive (:meth:`seal` closes
    it early), so a transfer of many files holds one descriptor at a time.
    """

    def __init__(self, store: NodeStore, parts: list[str], tmp: str, fd: int) -> None:
        self._store = store
        self._parts = parts
        self._tmp = tmp
        self._fd: int | None = fd
        self.committed = False
        self._gone = False

    @property
    def path(self) -> str:
        """Where the file goes."""
        return os.path.join(self._store.root, *self._parts)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._fd is None:
            raise ObjckptError(f"{self.path}: written after it was sealed")
        view = memoryview(data).cast("B")
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def seal(self) -> None:
        """fsync and close the file (its bytes are all written)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def commit(self, *, create_only: bool = False) -> None:
        """Rename the file into place and fsync its directory; on failure the
        temporary file is removed and the error raised.

        Args:
            create_only: Put it in place only if nothing has the name (a hard link,
                which fails if the name exists, as :class:`~objckpt.writers.local.LocalStore`
                commits), else raise ``FileExistsError``.
        """
        try:
            self.seal()
            dir_fd = self._store._open_dir(self._parts[:-1], create=False)
            try:
                name = self._parts[-1]
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                        raise self._store._refuse(dir_fd, self._parts[:-1], name)
                if create_only:
                    os.link(self._tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    self.committed = True  # in place: what follows cannot undo it
                    try:
                        os.unlink(self._tmp, dir_fd=dir_fd)
                    except OSError as exc:
                        logger.warning("local tier: cannot remove %s: %s", self._tmp, exc)
                else:
                    os.rename(self._tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self._gone = self.committed = True
                os.fsync(dir_fd)  # a failure says the name may not survive a crash
            finally:
                os.close(dir_fd)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Remove the temporary file (nothing once committed); never raises."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._gone:
            return
        self._gone = True
        try:
            dir_fd = self._store._open_dir(self._parts[:-1], create=False)
        except (OSError, ObjckptError) as exc:
            logger.warning("local tier: cannot remove the temporary file %s: %s", self._tmp, exc)
            return
        try:
            os.unlink(self._tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("local tier: cannot remove the temporary file %s: %s", self._tmp, exc)
        finally:
            os.close(dir_fd)

    def __enter__(self) -> PendingFile:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.committed:
            self.discard()
