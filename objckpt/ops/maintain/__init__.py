"""Maintenance of a root: which steps to keep, deleting them, collecting garbage over the
live set, verifying and copying checkpoints.
"""
