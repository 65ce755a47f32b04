"""Where the objects a step references are: its sibling step directories' stores.

A manifest key ``../step-<N>/<key>`` (:mod:`objckpt.format.refs`) is relative to the
step's own directory. A store's paths resolve it
(:meth:`objckpt.writers.location.Location.key_path`), so reading and copying need
nothing more; ``verify`` also wants to say *which* step stores a bad object, so it
resolves each reference here, once, to the sibling directory's store and the key
inside it, and its messages name both steps: the one that stores the bytes and the
one that references them.
"""

from __future__ import annotations

from objckpt.format.ref_check import sibling
from objckpt.format.refs import is_reference, split_reference
from objckpt.writers import ObjectStore

__all__ = ["Siblings"]


class Siblings:
    """The stores of the step directories beside ``store``'s, opened once each (they
    share ``store``'s filesystem and options)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._open: dict[str, ObjectStore] = {}

    def resolve(self, key: str) -> tuple[ObjectStore, str]:
        """``(store, key inside it)`` that holds the object ``key`` of the step.

        Raises:
            ManifestError: ``key`` is a malformed reference.
        """
        if not is_reference(key):
            return self.store, key
        step_dir, inner = split_reference(key, f"manifest of {self.store.location.url}")
        found = self._open.get(step_dir)
        if found is None:
            where = sibling(self.store.location, step_dir)
            found = self.store.at(where)
            self._open[step_dir] = found
        return found, inner

    def close(self) -> None:
        for s in self._open.values():
            s.close()
        self._open.clear()
