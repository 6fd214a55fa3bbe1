"""The fault spec: which faults a group injects, read from ``RINGCOMM_FAULTS`` or given to
``ringcomm.faults.inject``.

Why a spec of its own: a fault-injection test must say exactly which message of which call
of which op on which rank goes wrong, the same way on every rank (it is a must-match
setting), and a spec that cannot be read must fail at init quoting the part that is wrong,
not act differently from what was meant. The grammar, one rule per fault::

    SPEC   = RULE (";" RULE)*
    RULE   = ACTION ":" KEY "=" VALUE ("," KEY "=" VALUE)*
    ACTION = kill | delay | drop | corrupt
    KEY    = rank (required) | op | call | msg | seed | peer | ms

``rank`` acts; ``op`` names the op as errors print it (``allreduce``, ``broadcast``,
``send``...; default any op); ``call`` is the 1-based count of that op on that rank
(default 1); ``msg`` the 0-based index of that rank's outgoing messages or board posts
within the op, among those the rule selects (default 0; ``random`` picks one, from
``seed``); ``peer`` selects messages to that rank only; ``ms`` is a delay's length.

Stdlib only (this is ``core``): the wrappers that act on a spec are ``ringcomm.faults``.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIONS = ("kill", "delay", "drop", "corrupt")
# the ops a rule may name, as errors print them: the collectives' wire kinds, and ``send``
# (a point-to-point send; a receive sends nothing). tests/test_faults.py checks that this is
# every kind of ``ringcomm.transport.header.OpKind`` that carries data.
OPS = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather",
       "scatter", "alltoall", "barrier", "send")
KEYS = ("rank", "op", "call", "msg", "seed", "peer", "ms")
RANDOM = -1  # ``msg=random``: one message of the call, picked from ``seed``


@dataclass(frozen=True)
class FaultRule:
    """One fault: ``action`` by ``rank`` on message ``msg`` (``RANDOM``: picked from ``seed``)
    of call ``call`` of ``op`` (None: any op), to ``peer`` only where given; ``ms`` for a
    delay."""

    action: str
    rank: int
    op: str | None = None
    call: int = 1
    msg: int = 0
    seed: int = 0
    peer: int | None = None
    ms: float = 0.0

    def __str__(self) -> str:
        keys = [f"rank={self.rank}"]
        if self.op is not None:
            keys.append(f"op={self.op}")
        keys.append(f"call={self.call}")
        keys.append("msg=random" if self.msg == RANDOM else f"msg={self.msg}")
        if self.msg == RANDOM:
            keys.append(f"seed={self.seed}")
        if self.peer is not None:
            keys.append(f"peer={self.peer}")
        if self.action == "delay":
            keys.append(f"ms={self.ms:g}")
        return f"{self.action}:{','.join(keys)}"


@dataclass(frozen=True)
class FaultSpec:
    """The rules of one spec, in the order written. ``str`` is its canonical text (every
    key spelled out), which is what ranks compare at init."""

    rules: tuple[FaultRule, ...]

    def __str__(self) -> str:
        return ";".join(str(rule) for rule in self.rules)

    def __bool__(self) -> bool:
        return bool(self.rules)


def parse(text: str) -> FaultSpec:
    """The spec ``text`` says; ``ValueError`` quoting the part that cannot be read (and what
    would be right there) otherwise. Empty rules (a trailing ``;``) are ignored."""
    if not isinstance(text, str):
        raise ValueError(f"is not a fault spec (a string), got {type(text).__name__}")
    rules = tuple(_rule(part.strip()) for part in text.split(";") if part.strip())
    if not rules:
        raise ValueError("names no fault; write ACTION:rank=R,... (e.g. 'kill:rank=1')")
    return FaultSpec(rules)


def _rule(part: str) -> FaultRule:
    action, colon, rest = part.partition(":")
    action = action.strip().lower()
    if action not in ACTIONS:
        raise ValueError(f"has an unknown action {action!r} in {part!r}; use one of "
                         f"{', '.join(ACTIONS)}")
    if not colon or not rest.strip():
        raise ValueError(f"gives {action!r} no keys in {part!r}; it needs at least rank= "
                         f"(e.g. '{action}:rank=1')")
    values: dict[str, str] = {}
    for item in rest.split(","):
        key, equals, raw = (s.strip() for s in item.partition("="))
        key = key.lower()
        if not equals or not raw:
            raise ValueError(f"has {item.strip()!r} in {part!r}, not KEY=VALUE")
        if key not in KEYS:
            raise ValueError(f"has an unknown key {key!r} in {part!r}; use {', '.join(KEYS)}")
        if key in values:
            raise ValueError(f"gives {key!r} twice in {part!r}")
        values[key] = raw
    if "rank" not in values:
        raise ValueError(f"does not say which rank acts in {part!r}: add rank=R")
    rank = _whole(values, "rank", part, lowest=0)
    assert rank is not None
    op = values.get("op", "").lower() or None
    if op is not None and op not in OPS:
        raise ValueError(f"has an unknown op {values['op']!r} in {part!r}; use one of "
                         f"{', '.join(OPS)}")
    call = _whole(values, "call", part, lowest=1)
    msg_raw = values.get("msg", "0").lower()
    msg = RANDOM if msg_raw == "random" else _whole(values, "msg", part, lowest=0)
    if "seed" in values and msg != RANDOM:
        raise ValueError(f"gives a seed without msg=random in {part!r}")
    seed = _whole(values, "seed", part, lowest=0)
    peer = _whole(values, "peer", part, lowest=0)
    if peer is not None and peer == rank:
        raise ValueError(f"has peer={peer}, the acting rank itself, in {part!r}: a rank "
                         "sends no message to itself")
    ms = 0.0
    if action == "delay":
        if "ms" not in values:
            raise ValueError(f"gives the delay no length in {part!r}: add ms=N")
        try:
            ms = float(values["ms"])
        except ValueError:
            ms = -1.0
        if not 0 <= ms <= 3_600_000:
            raise ValueError(f"has ms={values['ms']!r} in {part!r}, not a number of "
                             "milliseconds from 0 to 3600000")
    elif "ms" in values:
        raise ValueError(f"gives ms to {action!r} in {part!r}; only a delay takes ms")
    return FaultRule(action, rank, op, call if call is not None else 1,
                     msg if msg is not None else 0, seed or 0, peer, ms)


def _whole(values: dict[str, str], key: str, part: str, *, lowest: int) -> int | None:
    raw = values.get(key)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = lowest - 1
    if value < lowest:
        raise ValueError(f"has {key}={raw!r} in {part!r}, not a whole number of {lowest} "
                         "or more" + (" (or random)" if key == "msg" else ""))
    return value


# ------------------------------------------------------------------ injected by the API
_injected: list[tuple[FaultSpec | None, bool | None]] = []  # ringcomm.faults.inject's, nested


def push(spec: FaultSpec | None, checksum: bool | None) -> None:
    """Make ``spec`` (None: no faults) and ``checksum`` (None: as the environment says) what
    communicators made from now on propose, instead of the environment (until ``pop``)."""
    _injected.append((spec, checksum))


def pop() -> None:
    """Undo the latest ``push``."""
    _injected.pop()


def injected() -> tuple[bool, FaultSpec | None, bool | None]:
    """Whether ``push`` holds, and if so its spec and checksum switch."""
    if not _injected:
        return False, None, None
    spec, checksum = _injected[-1]
    return True, spec, checksum
