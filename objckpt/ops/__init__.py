"""The operations layer: what a training job and an operator do with many checkpoints.

``manager`` (the training-loop facade), ``retention``, ``backup``, ``gc``,
``verify`` and ``config`` (the TOML file). Builds on every layer below.
"""
