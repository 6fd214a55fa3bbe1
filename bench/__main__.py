"""``python -m bench`` is ``ringcomm bench``."""

import sys

from .cli import main

sys.exit(main())
