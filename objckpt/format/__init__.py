"""The format layer: what a checkpoint is on the store.

Object names (``layout``), the manifest and its JSON form of DCP metadata
(``manifest``, ``dcp_json``), the commit protocol (``commit``) and how a root's
steps are named and listed (``steps``). Builds on the store layer
(:mod:`objckpt.writers`); knows nothing of DCP planning or async pipelines.
"""
