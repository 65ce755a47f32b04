"""The DCP plugin layer: torch.distributed.checkpoint's storage writer and reader.

``ObjectStoreWriter``/``ObjectStoreReader`` (public through :mod:`objckpt`), how
write items are packed into payload objects (``plan``) and serialized
(``serialize``). Builds on the format and store layers.
"""
