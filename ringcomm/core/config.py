"""The table of settings: every ``RINGCOMM_*`` variable and ``init`` argument, with its class,
its default and its parser, in one place that every module asks.

Why one table: a setting parsed where it is used gets its default written twice (in the help
text and a module constant) and its bad values refused differently in each place. Here each
row carries both, ``value(name)`` parses the environment through it (once per distinct raw
value), and ``ringcomm env``, the help of ``ringcomm.plan.settings`` and the errors all read
the same row.

Every setting is in one of three classes:

- *must match*: a rank-local difference would make ranks run different schedules or speak
  differently on the wire, so it is an ``ArgumentError`` at init on every rank, naming the
  setting, the values and the ranks;
- *agreed*: rank 0's value is published and used by every rank;
- *local*: legitimately per rank (its address, its timeout, how long it spins).

Stdlib only: ``import ringcomm`` reads ``RINGCOMM_DEBUG`` through it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, NamedTuple

from ..errors import ArgumentError
from . import fault_spec
from .algorithms import ALLREDUCE_OVER_LINKS


class Scope(Enum):
    MUST_MATCH = "must match"
    AGREED = "agreed"
    LOCAL = "local"


class Unset(Exception):  # noqa: N818 - not an error: the raw value means "the default"
    """Raised by a parser for a value that stands for the default."""


@dataclass(frozen=True)
class Setting:
    """One knob: its name in the agreement, where a user sets it, what it does, its default
    (``None``: computed where it is used, as ``default_text`` says) and how a raw value of
    its variable becomes a value (``parse`` raises ``ValueError`` saying what it must be)."""

    name: str
    scope: Scope
    env: str | None
    argument: str | None
    meaning: str
    default: Any = None
    parse: Callable[[str], Any] | None = None
    default_text: str = ""  # for people, where the default is not just ``default``
    secret: bool = False  # its value is never shown (``ringcomm env`` says only "set")

    @property
    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return "unset" if self.default is None else str(self.default)


# ------------------------------------------------------------------- parsers
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("is not a switch: use 1 or 0 (true/false, yes/no and on/off work too)")


def _number(lo: float, hi: float, unit: str) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise ValueError(f"is not a number of {unit} from {lo:g} to {hi:g}")
        return value
    return parse


def _count(what: str) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"is not a whole number of {what}") from None
        if value < 0:
            raise ValueError(f"is negative; use 0 or a number of {what}")
        return value
    return parse


def _positive(what: str) -> Callable[[str], int]:
    count = _count(what)

    def parse(raw: str) -> int:
        value = count(raw)
        if value == 0:
            raise ValueError(f"is 0; use a positive number of {what}")
        return value
    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"is not one of {', '.join(choices)}")
        return value
    return parse


def _algorithm(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ALLREDUCE_OVER_LINKS:
        raise ValueError(f"is not an allreduce algorithm; use one of "
                         f"{', '.join(ALLREDUCE_OVER_LINKS)}")
    return value


def _text(raw: str) -> str:
    if not raw.strip():
        raise Unset
    return raw


def _faults(raw: str) -> fault_spec.FaultSpec:
    if not raw.strip():
        raise Unset
    return fault_spec.parse(raw)


def _debug(raw: str) -> str:
    value = raw.strip().upper()
    if value not in ("WARN", "WARNING", "INFO", "DEBUG"):
        raise ValueError("is not one of INFO, DEBUG or WARN")
    return "WARNING" if value == "WARN" else value


_PORT_RANGE_FORM = "LOW-HIGH, ports from 1 to 65535 with LOW <= HIGH, such as 40000-40999"


def _port_range(raw: str) -> tuple[int, int]:
    """``LOW-HIGH`` (both ends in, spaces around either allowed) as ``(LOW, HIGH)``."""
    if not raw.strip():
        raise Unset
    low, dash, high = raw.partition("-")
    try:
        if not dash:
            raise ValueError
        ends = int(low.strip()), int(high.strip())
    except ValueError:
        raise ValueError(f"is not a range of tcp ports; use {_PORT_RANGE_FORM}") from None
    if not all(1 <= port <= 65535 for port in ends):
        raise ValueError(f"names a port outside 1-65535; use {_PORT_RANGE_FORM}")
    if ends[0] > ends[1]:
        raise ValueError(f"ends below where it starts; use {_PORT_RANGE_FORM}")
    return ends


TRANSPORT_MODES = ("auto", "ipc", "tcp")
STORE_ROLES = ("auto", "serve", "join")
DEVICE_MODES = ("auto", "cuda", "fake", "off")
DEVICE_ENGINES = ("auto", "cuda-ipc", "staged", "nccl", "cuda-kernel")
DEFAULT_IPC_SLOTS = 4
DEFAULT_IPC_SLOT_BYTES = 4 << 20
DEFAULT_SPIN_US = 50.0
DEFAULT_INLINE_BYTES = 64 * 1024
DEFAULT_TRACE_EVENTS = 200_000

SETTINGS: tuple[Setting, ...] = (
    Setting("version", Scope.MUST_MATCH, None, None, "the ringcomm version"),
    Setting("wire", Scope.MUST_MATCH, None, None, "the wire format (header layout) version"),
    Setting("algorithm", Scope.MUST_MATCH, "RINGCOMM_ALGO", None,
            "forces one allreduce algorithm (" + ", ".join(ALLREDUCE_OVER_LINKS) + ") for "
            "every call", None, _algorithm, "unset: chosen per call"),
    Setting("transport", Scope.MUST_MATCH, "RINGCOMM_TRANSPORT", "transport",
            "auto, ipc or tcp: auto links ranks of one host by pipes and shared memory "
            "where both ends offer them, else by ipc sockets, and other hosts by tcp; ipc "
            "is auto, but ranks on different hosts get ipc sockets instead of tcp, which "
            "works only where they see the same files (network namespaces of one machine); "
            "tcp makes every pair a tcp socket (no shared memory, no board)", "auto",
            _choice(*TRANSPORT_MODES)),
    Setting("segment_bytes", Scope.AGREED, None, "segment_bytes",
            "bytes per message segment", None, None,
            "the profile's tuned size, else 2 MiB"),
    Setting("profile", Scope.AGREED, "RINGCOMM_PROFILE", None,
            "the cost model's constants from `ringcomm tune`", None, _text,
            "~/.cache/ringcomm/profile.json"),
    Setting("timeout", Scope.LOCAL, None, "timeout", "seconds an op may take on this rank",
            300.0),
    Setting("host", Scope.LOCAL, "RINGCOMM_IFADDR", "host",
            "the address other hosts reach this rank at", None, _text,
            "found from RINGCOMM_SOCKET_IFNAME, else the route to the store"),
    Setting("socket_ifname", Scope.LOCAL, "RINGCOMM_SOCKET_IFNAME", None,
            "interface name(s), comma-separated, first with an IPv4 address wins: the "
            "address other hosts reach this rank at, when init(host=) and RINGCOMM_IFADDR "
            "are unset", None, _text),
    Setting("port_range", Scope.LOCAL, "RINGCOMM_PORT_RANGE", None,
            "LOW-HIGH (such as 40000-40999, both ends in): the tcp ports this rank listens "
            "on, for a firewall that admits only those: its links' receiving sockets and "
            "its control socket. A rank needs one port per peer it reaches over tcp plus one "
            "for its control socket (world size under RINGCOMM_TRANSPORT=tcp), and ranks of "
            "one host that share the range need that many each, and each group of "
            "comm.split as many again; too few free ports is an ArgumentError naming the "
            "range. The store's port (MASTER_PORT, init(store=)) is apart, and so are "
            "NCCL's own sockets (RINGCOMM_DEVICE_ENGINE=nccl)",
            None, _port_range, "unset: ports the system picks"),
    Setting("shm", Scope.LOCAL, "RINGCOMM_SHM", None,
            "0 turns shared memory off; a pair uses it only where both ends offer it",
            True, _flag),
    Setting("board", Scope.LOCAL, "RINGCOMM_BOARD", None,
            "0 declines the shared board (allreduces of every size, small broadcasts, "
            "all-gathers and barriers among ranks of one host); a group uses it only where "
            "every rank offers it (x86 only)", True, _flag),
    Setting("board_compiled", Scope.LOCAL, "RINGCOMM_BOARD_COMPILED", None,
            "0 runs the board's one-shot round (a blocking allreduce that fits one post, "
            "on the caller's thread) in Python instead of in its compiled C, which the "
            "install builds where it finds a C compiler (without one the round is "
            "Python's); ranks may differ", True, _flag),
    Setting("mailbox", Scope.LOCAL, "RINGCOMM_MAILBOX", None,
            "1 lets small messages from local peers arrive through a shared-memory mailbox "
            "instead of the pipe (x86 only); either end may differ", False, _flag),
    Setting("shm_bytes", Scope.LOCAL, "RINGCOMM_SHM_BYTES", None,
            "capacity of this rank's outgoing shared-memory rings (published to its peers)",
            None, _positive("bytes"), "256 MiB shared among local peers, 8-32 MiB a ring"),
    Setting("spin_us", Scope.LOCAL, "RINGCOMM_SPIN_US", None,
            "microseconds a receive polls before it sleeps", DEFAULT_SPIN_US,
            _number(0, 1e6, "microseconds")),
    Setting("debug", Scope.LOCAL, "RINGCOMM_DEBUG", None,
            "INFO: one line per rank at start-up (host, links, agreed settings, versions); "
            "DEBUG: one line per op as well", None, _debug),
    Setting("inline_bytes", Scope.LOCAL, "RINGCOMM_INLINE_BYTES", None,
            "async collectives up to this size per buffer run on the caller's thread when "
            "nothing is queued (0: always on the worker)", None, _count("bytes"),
            "64 KiB where the host has two cores per rank, every size where it has not"),
    Setting("trace", Scope.LOCAL, "RINGCOMM_TRACE", "trace",
            "a folder: each rank writes a timeline of every op, step and message there "
            "(Chrome trace-event JSON; `ringcomm trace merge` and `plot` read it)",
            None, _text, "off"),
    Setting("trace_events", Scope.LOCAL, "RINGCOMM_TRACE_EVENTS", None,
            "events a rank's timeline keeps (the latest; older ones are counted as "
            "dropped)", DEFAULT_TRACE_EVENTS, _positive("events")),
    Setting("faults", Scope.MUST_MATCH, "RINGCOMM_FAULTS", None,
            "faults to inject where messages move, 'ACTION:KEY=VALUE,...;...' (kill, "
            "delay, drop, corrupt; rank, op, call, msg, peer, ms, seed): for testing how a "
            "job survives them", None, _faults, "none"),
    Setting("checksum", Scope.MUST_MATCH, "RINGCOMM_CHECKSUM", None,
            "1 adds a checksum to every message and board post, so corruption on the way "
            "is a ChecksumError naming the link, op and message", False, _flag),
    Setting("device", Scope.MUST_MATCH, "RINGCOMM_DEVICE", "device",
            "device memory (CuPy arrays, CUDA tensors) reduced on the device: cuda (CuPy "
            "and a GPU, else an error), fake (the strict numpy runtime, for tests), off "
            "(device arrays are staged through the host); auto is cuda where CuPy sees a "
            "GPU, else off. Ranks must end up with the same", "auto",
            _choice(*DEVICE_MODES)),
    Setting("device_engine", Scope.MUST_MATCH, "RINGCOMM_DEVICE_ENGINE", None,
            "which device engine moves device memory: cuda-ipc (ranks of one host map each "
            "other's device memory), staged (through page-locked host memory over the "
            "links, across hosts too), nccl (NCCL through CuPy: its own collectives, and "
            "ringcomm's schedules as NCCL groups; one GPU per rank, a communicator per group "
            "from a unique id rank 0 draws at set-up and the others read from the store), "
            "cuda-kernel (as auto, and allreduces, reduce-scatters and all-gathers take the "
            "kernel path wherever every rank's kernels run at once, on a runtime whose "
            "launch is not yet checked on a GPU too); auto takes cuda-ipc where every "
            "rank is on one host, else staged, and the kernel path where every rank's "
            "kernels run at once and the runtime's launch is checked",
            "auto", _choice(*DEVICE_ENGINES)),
    Setting("ipc_slots", Scope.AGREED, "RINGCOMM_IPC_SLOTS", None,
            "device staging slots per peer of the cuda-ipc engine (messages in flight)",
            DEFAULT_IPC_SLOTS, _positive("slots")),
    Setting("ipc_slot_bytes", Scope.AGREED, "RINGCOMM_IPC_SLOT_BYTES", None,
            "bytes of one cuda-ipc staging slot (a larger message goes in pieces)",
            DEFAULT_IPC_SLOT_BYTES, _positive("bytes")),
    Setting("fake_devices", Scope.LOCAL, "RINGCOMM_FAKE_DEVICES", None,
            "how many devices the fake runtime (RINGCOMM_DEVICE=fake) shows this process",
            1, _positive("devices")),
    Setting("fake_device_timeout", Scope.LOCAL, "RINGCOMM_FAKE_DEVICE_TIMEOUT", None,
            "seconds a fake-runtime stream waits before the fake reports a device hang (a "
            "GPU would wait forever)", 60.0, _number(0.01, 1e6, "seconds")),
    Setting("store_role", Scope.LOCAL, "RINGCOMM_STORE", None,
            "what rank 0 does about the store at its address (init(store='host:port') or "
            "MASTER_ADDR/MASTER_PORT): serve (it serves the store, and refuses one it did "
            "not start that answers there already), join (it joins the store served there "
            "apart from the ranks, as every other rank does), auto (it serves the store "
            "unless one answers there, and warns when it joins one it did not start). "
            "Read by rank 0 alone", "auto", _choice(*STORE_ROLES)),
    Setting("auth_token", Scope.LOCAL, "RINGCOMM_AUTH_TOKEN", "auth_token",
            "a shared secret: the store, every rank-to-rank tcp connection and every "
            "rank's control socket (over ipc too) admit only peers that hold it (and "
            "encrypt); never published or logged", None, _text,
            "unset: no authentication", secret=True),
)
BY_NAME = MappingProxyType({s.name: s for s in SETTINGS})

class Reading(NamedTuple):
    """A setting as read: its value (the default where unset or refused), the raw text of its
    variable (None where unset) and, for a raw value its parser refuses, why."""

    value: Any
    raw: str | None = None
    problem: str | None = None


_readings: dict[tuple[str, str], Reading] = {}


def read(name: str) -> Reading:
    """Setting ``name`` as this process's environment sets it, parsed by its row (once per
    distinct raw value), without raising: see ``value``."""
    setting = BY_NAME[name]
    raw = os.environ.get(setting.env) if setting.env else None
    if raw is None or raw == "":
        return Reading(setting.default)
    key = (name, raw)
    reading = _readings.get(key)
    if reading is None:
        assert setting.parse is not None, f"setting {name} has a variable but no parser"
        try:
            reading = Reading(setting.parse(raw), raw)
        except Unset:
            reading = Reading(setting.default, raw)
        except ValueError as err:
            reading = Reading(setting.default, raw, str(err))
        _readings[key] = reading
    return reading


def value(name: str) -> Any:
    """Setting ``name`` as this process's environment sets it, else its default. A value its
    parser refuses is an ``ArgumentError`` that quotes it and says what the setting takes."""
    reading = read(name)
    if reading.problem is not None:
        setting = BY_NAME[name]
        raise ArgumentError(f"{setting.env}={reading.raw!r} {reading.problem}; unset it for "
                            f"the default ({setting.shown_default})")
    return reading.value


def check_all() -> None:
    """Read every setting this process's environment sets, raising the first refused one:
    at init, so that a rank with a bad value fails before any link exists, and every rank
    hears of it at once (rather than one rank failing deep in the set-up while the others
    wait for it)."""
    for setting in SETTINGS:
        if setting.env is not None and setting.name != "debug":  # warned of at import
            value(setting.name)


def transport_mode(forced: str | None) -> str:
    """The socket kind a group's links use: ``forced`` (``init(transport=)``), else
    ``RINGCOMM_TRANSPORT``; an ``ArgumentError`` for a mode there is not."""
    mode = (forced or value("transport")).lower()
    if mode not in TRANSPORT_MODES:
        raise ArgumentError(f"transport {mode!r} is unknown (from RINGCOMM_TRANSPORT or "
                            f"transport=); use {', '.join(TRANSPORT_MODES)}")
    return mode
