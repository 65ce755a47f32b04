"""The DCP plugin layer: torch.distributed.checkpoint's storage writer and reader.

``ObjectStoreWriter``/``ObjectStoreReader`` (public through :mod:`objckpt`), how
write items are packed into payload objects (``plan``) and serialized
(``serialize``); the reader's steps live in ``manifest_source``, ``read_plan``,
``fetch``, ``delivery`` and ``local_copy``; ``collective`` is every collective
objckpt makes. Builds on the format and store layers.
"""
