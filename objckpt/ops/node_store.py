"""The one door through which objckpt writes a file on a node's local tier.

A tier's directory is a place users and other tools reach too, so what sits under
it is untrusted, as bucket contents are. Two things must never happen to a file
objckpt writes there, and both are guarded here, once, for every writer:

* **A write through a symbolic link.** A link anywhere under the tier's root (at
  ``replicas/``, at a step's directory, at an entropy sub-directory or at the file's
  own name) leads to a directory that is not the tier's own, and objckpt cannot tell
  whose it is. Every component under the root is checked with ``lstat`` and opened
  with ``O_NOFOLLOW`` relative to its parent's descriptor, so a link is refused even
  when it appears between the check and the write, and the refusal names it
  (:class:`~objckpt.errors.LinkRefusedError`). The root itself may be a link: it is
  what the user configured.
* **A half-written file under its final name.** Bytes go to a temporary name in the
  destination directory (``.<name>.<32 hex>.tmp``, the name the tier's start-up sweep
  knows as a crash leftover), the file is fsynced, renamed into place, and the
  directory fsynced, so a file under its name is whole and survives a power loss.
  Any failure, or leaving the write without committing it, removes the temporary
  file: a failed transfer leaves nothing behind.

Directories are made component by component, each checked the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import stat
import uuid
from types import TracebackType

from objckpt.errors import LinkRefusedError, ObjckptError

__all__ = ["NodeStore", "PendingFile"]

logger = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(rel: str) -> list[str]:
    """The components of a path relative to the root, refused unless every one is a
    plain name (no empty, ``.`` or ``..`` component, not absolute)."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ObjckptError(
            f"refusing to write {rel!r} on the local tier: not a plain relative path"
        )
    return parts


def _link_target(dir_fd: int, name: str) -> str:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:
        return "?"


@dataclasses.dataclass(frozen=True)
class NodeStore:
    """Writes under one tier root, never through a link, each file whole or not at all.

    Args:
        root: The tier's directory (made when missing; it may itself be a link).
    """

    root: str

    def _refuse(self, dir_fd: int, parts: list[str], name: str) -> LinkRefusedError:
        path = os.path.join(self.root, *parts, name)
        return LinkRefusedError(
            f"{path} is a symbolic link to {_link_target(dir_fd, name)}; objckpt never "
            "writes through a link on the local tier (remove it, or move the directory back)"
        )

    def _open_dir(self, parts: list[str], create: bool) -> int:
        """A descriptor of ``root/parts...``, each component checked (and made, with
        ``create``) without following a link. The root is made when missing (a
        replaced node's tier starts empty): it is the path the user configured."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for i, part in enumerate(parts):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise self._refuse(fd, parts[:i], part)
                try:
                    inner = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:  # became a link after the check
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
                    self.committed = True
                    os.unlink(self._tmp, dir_fd=dir_fd)
                else:
                    os.rename(self._tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                self._gone = self.committed = True
                os.fsync(dir_fd)
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
