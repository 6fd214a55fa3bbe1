"""``ringcomm bench`` dispatch: the collective sweep, or ``ddp`` for the training benchmark."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """``ringcomm bench [ddp] ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "ddp":
        from . import ddp_step

        return ddp_step.main(argv[1:])
    from . import sweep

    return sweep.main(argv)
