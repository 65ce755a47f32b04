"""The adlfs filesystem objckpt builds for ``az://``, ``abfs://`` and ``abfss://``.

Why a subclass: an owner of its clients (:class:`~objckpt.writers.clients.OwnedClients`,
an ``AsyncCheckpointer``) closes their connections and then ends the event loop they
ran on. adlfs closes its service client only from a ``weakref.finalize`` hook
registered with the filesystem, which runs at interpreter exit on the loop the
filesystem was built with; once that loop is closed, the hook fails ("Loop is not
running") and aiohttp reports the session it never closed. :meth:`close_connections`
closes the service client (and an async credential) on the loop while it runs, and
retires adlfs's two hooks for this filesystem, which have nothing left to do.
"""

from __future__ import annotations

import inspect
import weakref

from adlfs import AzureBlobFileSystem
from fsspec.asyn import sync

__all__ = ["ClosableAzureBlobFileSystem"]


class ClosableAzureBlobFileSystem(AzureBlobFileSystem):
    """adlfs's ``AzureBlobFileSystem`` whose connections can be closed on its loop."""

    async def close_connections(self) -> None:
        """Close the service client and credential now (see the module docstring);
        the filesystem cannot send requests afterwards."""
        await self.service_client.close()
        credential = getattr(self, "credential", None)
        close = getattr(credential, "close", None)
        if close is not None:
            closed = close()
            if inspect.isawaitable(closed):
                await closed
        # adlfs's exit hooks are ``weakref.finalize(self, sync, loop, close_*, self)``;
        # the registry is the only way to find them (finalize has no lookup by object).
        for hook in list(getattr(weakref.finalize, "_registry", {})):
            held = hook.peek()
            if held is not None and held[0] is self and held[1] is sync:
                hook.detach()
