"""The operations layer: what a training job and an operator do with many checkpoints.

``manager`` is the training-loop facade over ``catalog`` (which steps exist, decided
on rank 0), ``saving`` (one save as its phases, top to bottom), ``local_tier`` (the
node-local tier's sweep, retention and promotion bookkeeping), ``durable`` (what
follows a commit on the root: backups, retention) and ``restore`` (which copy a load
reads). Beside them: ``retention``, ``backup``, ``gc``, ``verify``, ``export`` and
``config`` (the TOML file). Builds on every layer below.
"""
