"""The shared board's one-shot round in C (``_board_round.c``; ``Board.round_whole``)."""

from typing import Any

LINE: int
SLOT_BYTES: int
HEADER_SIZE: int

def round_whole(board: Any, rank: int, world_size: int, number: int, header: bytes,
                data: Any, takes: tuple[tuple[int, int, bool], ...], op: int, turns: int,
                wakes_by_flag: bool) -> int: ...
