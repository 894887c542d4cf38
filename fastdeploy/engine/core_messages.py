"""The wire format between the API process and the engine core process.

Every ZMQ message is multipart: a one-byte kind, then msgpack payload frames
(msgspec). Requests go API -> core on a PUSH/PULL pair; outputs come back on
another.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgspec

from fastdeploy.engine.request import EngineCoreOutputs, EngineCoreRequest


class EngineCoreRequestType(bytes, enum.Enum):
    """Kind of a message sent to the engine core."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class EngineCoreOutputType(bytes, enum.Enum):
    """Kind of a message sent by the engine core."""

    # Frames: kind, EngineCoreOutputs, step start time (float64, time.time()).
    OUTPUTS = b"\x00"
    UTILITY = b"\x01"
    # The core hit an unrecoverable error; frame 1 is the error text.
    DEAD = b"\x02"


class UtilityCall(msgspec.Struct, array_like=True):
    """A method call on the engine core (``reset_prefix_cache``, ...) answered by a UtilityResult."""

    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


# Methods of EngineCore the API process may call remotely.
UTILITY_METHODS = frozenset({"reset_prefix_cache", "ping", "switch_role"})

_FLOAT = struct.Struct("<d")

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
abort_decoder = msgspec.msgpack.Decoder(list[str])
utility_call_decoder = msgspec.msgpack.Decoder(UtilityCall)
utility_result_decoder = msgspec.msgpack.Decoder(UtilityResult)


def pack_time(t: float) -> bytes:
    return _FLOAT.pack(t)


def unpack_time(data: bytes | memoryview) -> float:
    return _FLOAT.unpack(data)[0]
