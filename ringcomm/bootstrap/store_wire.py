"""The store's wire protocol: what a request and a reply are, checked on arrival.

One ZeroMQ multipart message each way, no pickle::

    request:  [request id (8 B)] [command] [arguments...]
    reply:    [request id (8 B)] [status] [results...]

The statuses are ``ok``, ``timeout`` (a blocking ``get`` or ``wait`` whose keys did not
appear: the results name them), ``error`` (refused: the result says why) and ``leaving``
(this server is going away with the group that serves it and takes no new clients: ask
again, and the next store at the address answers).

A client names itself on the wire: each of its sockets connects with the ZeroMQ routing id
``client id + socket number`` (``socket_identity``), so the server can tell a client it
has served (any of its threads, on a socket it opens later) from one it has never seen
(``client_of``). A peer that picks no routing id is a client of its own.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 64 << 20
MAX_KEYS = 1 << 14  # in one wait or check
MAX_FRAME_BYTES = MAX_VALUE_BYTES + 64  # ZeroMQ drops a connection that sends more in a frame
# A whole request: the largest the protocol takes is a compare_set of two values (a wait or
# a check of MAX_KEYS keys of MAX_KEY_BYTES is half that), in at most MAX_FRAMES frames (a
# wait: request id, command, timeout, keys). The store without a token closes a connection
# whose message passes either before reading on (``store_zmtp``).
MAX_MESSAGE_BYTES = 2 * MAX_VALUE_BYTES + (64 << 10)
MAX_FRAMES = MAX_KEYS + 3
MAX_TIMEOUT_DIGITS = 20  # a timeout in ms, as decimal text
MAX_INTEGER_DIGITS = 1000  # an amount to add and the value it adds to (Python ints are big)

REQUEST_ID = struct.Struct("<Q")

OK = b"ok"
TIMEOUT = b"timeout"
ERROR = b"error"
LEAVING = b"leaving"

# command -> (fewest, most arguments)
ARITY: dict[bytes, tuple[int, int]] = {
    b"set": (2, 2), b"get": (2, 2), b"wait": (2, MAX_KEYS + 1), b"add": (2, 2),
    b"check": (1, MAX_KEYS), b"compare_set": (3, 3), b"delete": (1, 1), b"num_keys": (0, 0),
    b"ping": (0, 0), b"leave": (2, 2)}

# A client's routing id: a marker byte (never 0: ZeroMQ keeps ids starting with 0 for the
# ones it makes up), 7 random bytes, then the socket's number.
_CLIENT_MARK = b"C"
_CLIENT_ID_BYTES = 8
_SOCKET_NUMBER = struct.Struct(">I")


def new_client_id() -> bytes:
    """A fresh client's name on the wire (random: clients of many processes meet)."""
    return _CLIENT_MARK + os.urandom(_CLIENT_ID_BYTES - len(_CLIENT_MARK))


def socket_identity(client_id: bytes, number: int) -> bytes:
    """The routing id of socket ``number`` of client ``client_id``."""
    return client_id + _SOCKET_NUMBER.pack(number)


def client_of(identity: bytes) -> bytes:
    """The client a connection's routing id belongs to (``socket_identity``'s client id, or
    the routing id itself for a peer that named no client)."""
    if len(identity) == _CLIENT_ID_BYTES + _SOCKET_NUMBER.size and \
            identity.startswith(_CLIENT_MARK):
        return identity[:_CLIENT_ID_BYTES]
    return identity


def is_number(raw: bytes, *, signed: bool = False, most: int = MAX_TIMEOUT_DIGITS) -> bool:
    """Whether ``raw`` is decimal text of 1 to ``most`` digits (a leading ``-`` if signed)."""
    digits = raw[1:] if signed and raw[:1] == b"-" else raw
    return 0 < len(digits) <= most and digits.isdigit()


def parse_request(frames: Sequence[bytes]) -> tuple[bytes, bytes, list[bytes]]:
    """A request's ``(request id, command, arguments)``, checked against the protocol: a
    known command with as many arguments as it takes, keys of 1 to ``MAX_KEY_BYTES`` bytes,
    values of at most ``MAX_VALUE_BYTES``, numbers as short decimal text. Anything else is a
    ``ValueError`` saying what was wrong (nothing is allocated from what it claims).

    ``leave`` takes a group's name (checked as a key) and a rank: that rank of the group is
    done with the store (``StoreServer.own``)."""
    if len(frames) < 2:
        raise ValueError(f"{len(frames)} frame(s) after the identity (a request has a "
                         "request id and a command)")
    request_id, command, args = frames[0], frames[1], list(frames[2:])
    if len(request_id) != REQUEST_ID.size:
        raise ValueError(f"a request id of {len(request_id)} B (it is {REQUEST_ID.size})")
    arity = ARITY.get(command)
    if arity is None:
        raise ValueError(f"unknown command {command[:32]!r}")
    if not arity[0] <= len(args) <= arity[1]:
        raise ValueError(f"{command.decode()} takes {arity[0]}"
                         + (f" to {arity[1]}" if arity[1] != arity[0] else "")
                         + f" argument(s), got {len(args)}")
    if command in (b"get", b"wait"):
        if not is_number(args[0]):
            raise ValueError(f"timeout {args[0][:32]!r} is not a number of milliseconds")
        keys = args[1:]
    elif command == b"check":
        keys = args
    else:
        keys = args[:1]
    for key in keys:
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a key of {len(key)} B (keys are 1 to {MAX_KEY_BYTES} B)")
    if command == b"add" and not is_number(args[1], signed=True, most=MAX_INTEGER_DIGITS):
        raise ValueError(f"amount {args[1][:32]!r} is not an integer")
    if command == b"leave" and not is_number(args[1]):
        raise ValueError(f"rank {args[1][:32]!r} is not a number")
    values = args[1:] if command in (b"set", b"compare_set") else []
    for value in values:
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"a value of {len(value)} B (at most {MAX_VALUE_BYTES} B)")
    return request_id, command, args
