"""``python -m ringcomm``: the ``ringcomm`` command."""

from .cli import main

main()
