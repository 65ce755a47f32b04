"""The ``objckpt`` command line (click); :func:`main` is the console script.

Commands: ``ls``, ``info``, ``verify``, ``gc``, ``rm``, ``cp``, ``export``,
``import``, ``demo``, one module per group (see :mod:`objckpt.cli.app`). Endpoint
and credentials come from the standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``STORAGE_EMULATOR_HOST``, ...), from a
config file (``--config`` or ``OBJCKPT_CONFIG``) and from repeatable
``--storage-option KEY=VALUE`` (which wins). ``--json`` prints one JSON document
on stdout for scripts; logs and progress go to stderr.

Exit codes: 0 success; 1 a check failed (``verify`` found a bad object); 2 usage
error (also a URL that does not parse, a malformed ``--storage-option`` or one the
backend does not take); 3 no such checkpoint, not committed, or no such bucket; 4
any other objckpt error (store unreachable or silent past ``--deadline``, access
denied, invalid manifest or config).
"""

from objckpt.cli.app import main

__all__ = ["main"]
