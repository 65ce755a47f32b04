"""Background staging: the copy into staging that runs after ``save()`` returned.

With ``AsyncOptions(background_staging=True)`` the training loop does not wait
for the copy into host memory; it only promises not to change its tensors in
place until the copy ends. :class:`Copy` runs that copy once, for whoever needs
the bytes first, and checks the promise with each tensor's version counter.
"""

from __future__ import annotations

import threading

import torch

from objckpt._torch import version_counters
from objckpt.errors import StateDictError
from objckpt.pipeline.host_copy import HostCopier

__all__ = ["Copy", "tensor_versions"]


class Copy:
    """The copy of a state dict into its staging views, when it runs after ``save()``
    returned (``AsyncOptions.background_staging``).

    The caller promised not to change the tensors in place until ``finished`` is
    set; the promise is checked: each tensor's version counter (bumped by every
    in-place op, an optimizer step's included) is read when ``save()`` is called
    and again after the copy, and a changed one fails the save instead of saving
    a mix of two steps. (Writes through ``.data`` or a NumPy view bump nothing and
    go unseen.)
    """

    def __init__(
        self,
        sources: list[torch.Tensor],
        views: list[torch.Tensor],
        paths: list[str],
        versions: list[int],
        cuda: bool,
        copier: HostCopier,
    ) -> None:
        self._copier = copier
        self._sources = sources
        self._views = views
        self._paths = paths
        self._versions = versions
        self._cuda = cuda
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._ran = False
        #: Set once the copy has ended (whatever its outcome).
        self.finished = threading.Event()

    def run(self) -> None:
        """Copy (once; later calls re-raise the first outcome).

        Raises:
            StateDictError: A tensor was changed in place before its copy ended.
        """
        with self._lock:
            if not self._ran:
                self._ran = True
                try:
                    self._copier.copy(self._sources, self._views, self._cuda)
                    self._check()
                except BaseException as exc:
                    self._error = exc
                finally:
                    self._sources = []  # the caller's tensors are not held past the copy
                    self.finished.set()
            if self._error is not None:
                raise self._error

    def _check(self) -> None:
        now = version_counters(self._sources)
        if now is None:  # read at save(), so readable now; refuse rather than guess
            raise StateDictError(
                "the tensors' version counters could not be read after the background copy"
            )
        changed = [p for p, v, w in zip(self._paths, self._versions, now, strict=True) if v != w]
        if changed:
            shown = ", ".join(repr(p.lstrip(".")) for p in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise StateDictError(
                f"{len(changed)} tensor(s) changed in place before the background copy of "
                f"the save ended ({shown}{more}); nothing of this save is committed. With "
                "AsyncOptions(background_staging=True), call handle.wait_staged() before "
                "changing the state (before optimizer.step())"
            )


def tensor_versions(tensors: list[torch.Tensor]) -> list[int] | None:
    """Each tensor's version counter; None when one has none (inference tensors)."""
    return version_counters(tensors)
