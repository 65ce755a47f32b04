"""Keywords removed from public signatures, each refused with the spelling that replaced it.

Python's own ``TypeError: unexpected keyword argument 'keep_last'`` leaves the user to
find the new spelling in docs/changes.md; :func:`removed_keywords` wraps a public
callable (a function, or a class's ``__init__``) so that a removed keyword raises a
``TypeError`` naming its replacement instead. Each table below is the one list of
what an entry point lost (docs/changes.md says when and why).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

_T = TypeVar("_T", bound=Callable[..., Any])

#: ``CheckpointManager`` (#38: one way per setting).
MANAGER = {
    "keep_last": "retention=objckpt.RetentionPolicy(keep_last={value!r})",
    "keep_every": "retention=objckpt.RetentionPolicy(keep_every={value!r})",
    "keep_newer_than": "retention=objckpt.RetentionPolicy(keep_newer_than={value!r})",
}
#: ``LocalTier`` (#45: one value per concern, the root's retention value).
LOCAL_TIER = {"keep_last": "retention=objckpt.RetentionPolicy(keep_last={value!r})"}
#: ``ObjectStoreWriter`` (#45: how a save writes is one value).
WRITER = {"preflight_timeout": "upload=objckpt.UploadOptions(preflight_timeout={value!r})"}
#: ``ObjectStoreReader`` (#38; #45: how a load reads is one value).
READER = {
    "verify": "read=objckpt.ReadOptions(verify={value!r})",
    "broadcast": "read=objckpt.ReadOptions(broadcast={value!r})",
    "allow_stock": "read=objckpt.ReadOptions(allow_stock={value!r})",
    "local": "read=objckpt.ReadOptions(local={value!r})",
}
#: ``ReadOptions`` (November 2026 renames; #38).
READ_OPTIONS = {
    "max_inflight_bytes": "max_in_flight_bytes={value!r}",
    "share_replicated": (
        "objckpt.AsyncOptions(share_replicated={value!r}) on the save (a load shares "
        "replicated reads wherever the reader coordinates the process group)"
    ),
}
#: ``UploadOptions`` (November 2026 renames; #45: names say what they count).
UPLOAD_OPTIONS = {
    "max_inflight": "max_parts_in_flight={value!r}",
    "max_in_flight": "max_parts_in_flight={value!r} (parts; saves in flight are "
    "AsyncOptions.max_saves_in_flight)",
}
#: ``AsyncOptions`` (#45: names say what they count).
ASYNC_OPTIONS = {
    "max_in_flight": "max_saves_in_flight={value!r} (saves; parts in flight are "
    "UploadOptions.max_parts_in_flight)",
}
#: ``AsyncCheckpointer`` and ``async_save`` (November 2026 renames).
CHECKPOINTER = {"options": "async_options= (the same objckpt.AsyncOptions)"}


def replacement(cls: type, name: str, value: Any) -> str | None:
    """What replaced keyword ``name`` of class ``cls`` (None: it was never removed)."""
    removed: Mapping[str, str] = getattr(cls, "__removed_keywords__", {})
    return removed[name].format(value=value) if name in removed else None


def removed_keywords(removed: Mapping[str, str]) -> Callable[[_T], _T]:
    """Refuse the keywords of ``removed`` (name -> its replacement, where ``{value!r}``
    stands for the value given) with a ``TypeError`` that names the replacement.

    Decorates a function, or a class (its ``__init__``, generated ones included).
    """

    def decorate(target: _T) -> _T:
        is_class = isinstance(target, type)
        wrapped: Callable[..., Any] = target.__init__ if is_class else target
        owner = target.__qualname__

        @functools.wraps(wrapped)
        def checked(*args: Any, **kwargs: Any) -> Any:
            old = [k for k in kwargs if k in removed]
            if old:
                instead = "; ".join(
                    f"{k}= is gone, pass {removed[k].format(value=kwargs[k])}" for k in old
                )
                raise TypeError(f"{owner}(): {instead} (see docs/changes.md)")
            return wrapped(*args, **kwargs)

        if is_class:
            target.__init__ = checked  # type: ignore[method-assign]
            # Read by the config file, which names the replacement of a removed key too.
            target.__removed_keywords__ = dict(removed)  # type: ignore[attr-defined]
            return target
        return checked  # type: ignore[return-value]

    return decorate
