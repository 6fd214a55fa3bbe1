"""``ringcomm explain --animate``: the rounds one after another in the terminal (rich).

Each frame is one round: its messages, coloured as the SVG colours them (added into the
receiver's buffer, or copied over it), and every rank's buffers with the elements that
round wrote highlighted. A terminal sees the frames replace each other, after ``delay``
seconds or, with no delay, at each Enter; anything else (a pipe, a file) gets every frame
printed in turn.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .._support import install_hint
from ..errors import ArgumentError
from .explanation import Explanation
from .rounds import Round
from .text import UNKNOWN, headline, result_lines, round_title, shown, value_width

if TYPE_CHECKING:
    from rich.console import Console, RenderableType


def animate(ex: Explanation, *, delay: float = 1.5, console: Console | None = None) -> None:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise ArgumentError("--animate draws with rich, which is not installed: "
                            f"{install_hint('teach')}") from None
    console = console or Console()
    frames = [frame(ex, i) for i in range(len(ex.rounds))]
    if not console.is_terminal:
        for f in frames:
            console.print(f)
    else:
        with Live(frames[0], console=console, auto_refresh=False) as live:
            for f in frames[1:]:
                if delay > 0:
                    time.sleep(delay)
                else:
                    console.input("[dim]Enter: next round[/dim]")
                live.update(f, refresh=True)
    console.print("\n".join(result_lines(ex)), highlight=False)


def frame(ex: Explanation, index: int) -> RenderableType:
    """Round ``ex.rounds[index]`` as one rich panel."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    rnd = ex.rounds[index]
    previous = ex.rounds[index - 1] if index else None
    moves = Text()
    for t in rnd.transfers:
        moves.append(t.describe() + "\n", style="dark_orange" if t.reduces else "deep_sky_blue3")
    for c in rnd.copies:
        moves.append(f"rank {c.rank} copies {c.src} into {c.dst}\n", style="deep_sky_blue3")
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column("rank", style="bold")
    table.add_column("buffer", style="dim")
    table.add_column("values")
    width = value_width(ex)
    for rank in range(ex.call.world_size):
        for i, role in enumerate(r for r in ex.roles if shown(ex, rank, r)):
            table.add_row(f"rank {rank}" if i == 0 else "", role,
                          _values(rnd, previous, rank, role, width))
    body = Group(moves, table) if moves else table
    return Panel(body, title=round_title(rnd, ex), title_align="left", subtitle=headline(ex),
                 subtitle_align="right")


def _values(rnd: Round, previous: Round | None, rank: int, role: str,
            width: int) -> RenderableType:
    from rich.text import Text

    values = rnd.buffers[rank][role].tolist()
    known = rnd.known[rank][role].tolist()
    changed = rnd.changed(rank, previous, role).tolist()
    out = Text()
    for v, k, c in zip(values, known, changed, strict=True):
        out.append((str(v) if k else UNKNOWN).rjust(width),
                   style="bold yellow" if c else ("" if k else "dim"))
    return out
