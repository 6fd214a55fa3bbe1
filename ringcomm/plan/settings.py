"""Settings agreed: what ranks must share, and how they come to share it at init.

The table of every setting (its class, default and parser) is ``ringcomm.core.config``,
re-exported here; this module is the agreement built on it. At init every rank publishes
its proposal (its must-match and agreed values) and its facts (``topology.RankFacts``)
under one store key, reads everyone's, and checks. The result, the same on every rank, is a
``Settings`` and a ``Topology``: everything a communicator decides (which engine, which
algorithm, which segment size) is a function of these two and the op, so every rank decides
the same by construction.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__ as VERSION
from ..core import config, fault_spec
from ..core.config import BY_NAME, SETTINGS, Scope, Setting
from ..errors import ArgumentError, StoreError, StoreTimeout
from ..transport.header import WIRE_VERSION
from . import cost
from .topology import RankFacts, Topology

__all__ = ["SETTINGS", "Scope", "Setting", "Settings", "agree", "propose"]


@dataclass(frozen=True)
class Settings:
    """What every rank of one communicator runs with: identical on every rank."""

    algorithm: str | None = None
    transport: str = "auto"
    segment_bytes: int = cost.DEFAULT_SEGMENT_BYTES
    params: dict[int, cost.CostParams] = field(default_factory=dict)
    profile_source: str = "defaults"
    remote: cost.CostParams | None = None  # links between hosts; None: the defaults
    faults: fault_spec.FaultSpec | None = None  # what ringcomm.faults injects
    checksum: bool = False  # every message and board post carries a checksum
    device: str = "off"  # cuda, fake or off: the device runtime of the group (resolved)
    device_engine: str = "auto"  # auto, cuda-ipc or staged
    ipc_slots: int = config.DEFAULT_IPC_SLOTS
    ipc_slot_bytes: int = config.DEFAULT_IPC_SLOT_BYTES
    device_params: dict[str, cost.CostParams] = field(default_factory=dict)  # measured ones

    def device_cost(self, engine: str) -> cost.CostParams:
        """The cost model's parameters for device engine ``engine``: the profile's, where
        ``ringcomm tune`` measured them on a GPU, else the defaults."""
        return cost.Profile(devices=self.device_params).for_device(engine)

    def cost_params(self, world_size: int) -> cost.CostParams:
        return cost.Profile(self.params).for_world(world_size)

    @classmethod
    def local(cls, *, segment_bytes: int | None = None, transport: str | None = None,
              device: str | None = None) -> Settings:
        """This process's own view (environment, profile, arguments), unchecked: what a
        rank proposes, and what a group inside one process uses as it is."""
        return cls.from_proposal(propose(segment_bytes=segment_bytes, transport=transport,
                                         device=device))

    @classmethod
    def from_proposal(cls, proposal: dict[str, Any]) -> Settings:
        match, agreed = proposal["match"], proposal["agreed"]
        params = {int(n): cost.CostParams(**p) for n, p in agreed["params"].items()}
        remote = cost.CostParams(**agreed["remote"]) if agreed.get("remote") else None
        faults = fault_spec.parse(match["faults"]) if match.get("faults") else None
        return cls(match["algorithm"], match["transport"], int(agreed["segment_bytes"]),
                   params, agreed["profile_source"], remote, faults,
                   bool(match.get("checksum")), match.get("device") or "off",
                   match.get("device_engine") or "auto",
                   int(agreed.get("ipc_slots") or config.DEFAULT_IPC_SLOTS),
                   int(agreed.get("ipc_slot_bytes") or config.DEFAULT_IPC_SLOT_BYTES),
                   {name: cost.CostParams(**p)
                    for name, p in (agreed.get("device_params") or {}).items()})

    def describe(self) -> dict[str, Any]:
        """The agreed values, for logs and ``ringcomm env``."""
        described = {"algorithm": self.algorithm or "auto", "transport": self.transport,
                     "segment_bytes": self.segment_bytes, "profile": self.profile_source}
        if self.faults:
            described["faults"] = str(self.faults)
        if self.checksum:
            described["checksum"] = True
        if self.device != "off":
            described["device"] = self.device
            described["device_engine"] = self.device_engine
        return described


def device_mode(forced: str | None = None) -> str:
    """The device runtime this rank proposes, resolved: ``forced`` (``init(device=)``), else
    ``RINGCOMM_DEVICE``; ``auto`` becomes ``cuda`` where CuPy imports and sees a GPU, else
    ``off``. An ``ArgumentError`` for a mode there is not."""
    mode = forced if forced is not None else config.value("device")
    if not isinstance(mode, str) or mode.strip().lower() not in config.DEVICE_MODES:
        raise ArgumentError(f"device {mode!r} is unknown (from RINGCOMM_DEVICE or device=); "
                            f"use {', '.join(config.DEVICE_MODES)}")
    mode = mode.strip().lower()
    if mode != "auto":
        return mode
    import importlib.util

    if importlib.util.find_spec("cupy") is None:  # no CuPy here: auto means no device
        return "off"
    from ..core import device

    try:
        return "cuda" if device.runtime("cupy").available() else "off"
    except ArgumentError:  # no CuPy here: auto means no device
        return "off"


def propose(*, segment_bytes: int | None = None, transport: str | None = None,
            device: str | None = None) -> dict[str, Any]:
    """This rank's values of every must-match and agreed setting, checked for sense."""
    algorithm: str | None = config.value("algorithm")
    mode = config.transport_mode(transport)
    faults, checksum = _integrity()
    profile = cost.load_profile()
    if segment_bytes is None:
        segment_bytes = profile.segment_bytes or cost.DEFAULT_SEGMENT_BYTES
    if not isinstance(segment_bytes, int) or isinstance(segment_bytes, bool) or \
            segment_bytes <= 0:
        raise ArgumentError(f"segment_bytes must be a positive int, got {segment_bytes!r}")
    return {
        "match": {"version": VERSION, "wire": WIRE_VERSION, "algorithm": algorithm,
                  "transport": mode, "faults": str(faults) if faults else None,
                  "checksum": checksum, "device": device_mode(device),
                  "device_engine": config.value("device_engine")},
        "agreed": {"segment_bytes": segment_bytes, "profile_source": profile.source,
                   "params": {str(n): vars(p) for n, p in profile.params.items()},
                   "remote": vars(profile.remote) if profile.remote else None,
                   "ipc_slots": config.value("ipc_slots"),
                   "ipc_slot_bytes": config.value("ipc_slot_bytes"),
                   "device_params": {name: vars(p) for name, p in profile.devices.items()}},
    }


def _integrity() -> tuple[fault_spec.FaultSpec | None, bool]:
    """The faults and the checksum switch this rank proposes: ``ringcomm.faults.inject``'s
    while it holds, else ``RINGCOMM_FAULTS`` and ``RINGCOMM_CHECKSUM``."""
    held, spec, checksum = fault_spec.injected()
    faults = spec if held else config.value("faults")
    if checksum is None:
        checksum = bool(config.value("checksum"))
    return faults, checksum


def agree(store: Any, rank: int, world_size: int, timeout: float, *,
          proposal: dict[str, Any] | None = None, facts: RankFacts | None = None,
          failure: ArgumentError | None = None) -> tuple[Settings, Topology]:
    """Publish this rank's proposal and facts, read every rank's, and check them.

    Returns rank 0's agreed values and the table of every rank's facts, identical on every
    rank; raises ``ArgumentError`` (on every rank alike) when a must-match setting differs.
    A rank whose own settings were wrong passes its error as ``failure``: it publishes that
    instead, so the others raise at once, naming it, rather than wait out the timeout.
    ``store`` needs ``set``, ``wait`` and ``get``; the keys go under ``agree/``.
    """
    if failure is not None:
        mine = json.dumps({"failure": failure.detail})
    else:
        proposal = proposal if proposal is not None else propose()
        facts = facts or RankFacts.here()
        mine = json.dumps({"proposal": proposal, "facts": facts.to_json()})
    store.set(f"agree/{rank}", mine.encode())
    keys = [f"agree/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except StoreTimeout:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            raise
        it = "was it" if len(missing) == 1 else "were they"
        raise StoreTimeout(
            f"{_ranks(missing)} never joined within {timeout:g} s: {it} started, with the "
            f"same store address (MASTER_ADDR/MASTER_PORT or store=) and world size "
            f"({world_size})?") from None
    entries = []
    for r, key in enumerate(keys):
        raw = mine if r == rank else store.get(key).decode()
        try:
            entries.append(json.loads(raw))
        except ValueError:
            raise ArgumentError(f"rank {r} published an unreadable init record; is every "
                                "rank running the same ringcomm version?", rank=rank) from None
    # "read": rank 0, which may serve the store, waits for it before it raises and goes;
    # the reply to this set can then be lost with the store, which is fine
    with contextlib.suppress(StoreError):
        store.set(f"agree/read/{rank}", b"1")
    try:
        if failure is not None:
            raise failure
        failed = [(r, e["failure"]) for r, e in enumerate(entries) if "failure" in e]
        if failed:
            raise ArgumentError("; ".join(f"rank {r} could not join the group: {text}"
                                          for r, text in failed), rank=rank)
        _check_match([e["proposal"]["match"] for e in entries], rank)
    except ArgumentError:
        if rank == 0:  # it may serve the store: let everyone read before it goes
            with contextlib.suppress(Exception):
                store.wait([f"agree/read/{r}" for r in range(world_size)], timeout)
        raise
    settings = Settings.from_proposal(entries[0]["proposal"])
    topology = Topology(tuple(RankFacts.from_json(e["facts"]) for e in entries))
    return settings, topology


def _check_match(values: list[dict[str, Any]], rank: int) -> None:
    """Raise, the same way on every rank, for the first must-match setting that differs."""
    names = ["version", "wire", *(k for k in values[0] if k not in ("version", "wire"))]
    for name in names:
        seen: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            seen.setdefault(json.dumps(v.get(name)), []).append(r)
        if len(seen) == 1:
            continue
        setting = BY_NAME[name]
        where = " or ".join(x for x in (setting.env, setting.argument and
                                        f"init({setting.argument}=)") if x)
        parts = "; ".join(f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} "
                          f"{_show(json.loads(v))}" for v, rs in seen.items())
        if name in ("version", "wire"):
            what = "the ringcomm version" if name == "version" else "the wire format version"
            raise ArgumentError(f"ranks run different software: {what} differs ({parts}). "
                                "Install the same ringcomm on every host.", rank=rank)
        raise ArgumentError(
            f"ranks disagree on {name} ({where}): {parts}. It must be the same on every "
            "rank: set it on all of them or on none.", rank=rank)


def _show(value: Any) -> str:
    return "it unset" if value is None else repr(value)


def _ranks(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
