"""``ringcomm bench`` dispatch: the collective sweep, or ``ddp`` for the training benchmark."""

from __future__ import annotations

import importlib.util
import sys

from ringcomm._support import install_hint

# what the harness needs beyond ringcomm itself: the `bench` extra in pyproject.toml
EXTRA = install_hint("bench")
NEEDS = ("rich", "matplotlib")


def missing_modules() -> list[str]:
    """The modules of the ``bench`` extra that cannot be imported here, found without
    importing them, so a run without the extra stops before it starts any rank."""
    missing = []
    for name in NEEDS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def main(argv: list[str] | None = None) -> int:
    """``ringcomm bench [ddp] ...``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if missing := missing_modules():
        print(f"ringcomm bench needs its extra (missing: {', '.join(missing)}); install it "
              f"with: {EXTRA}", file=sys.stderr)
        return 2
    if argv and argv[0] == "ddp":
        from . import ddp_step

        return ddp_step.main(argv[1:])
    from . import sweep

    return sweep.main(argv)
