"""``python -m objckpt.cli``: the same command as the ``objckpt`` script."""

from objckpt.cli.app import main

main()
