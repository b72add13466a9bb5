"""The frames in which a ClientApp process and its node's warm worker (`deploy.worker`) hand each
other a request and its reply over a Unix socket: [u32 count] then, per part, [u64 length][bytes].

A Flower Message goes as frame parts (`message_parts`: its protobuf with every ArrayRecord
emptied, a JSON index of the arrays, then each array's bytes as Flower holds them) and comes
back whole (`message_from_parts`). Lengths and bytes, decoded by protobuf and JSON: no pickle.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Sequence
from typing import Any

MAX_PARTS = 1 << 16  # a frame's parts: a message's protobuf, its arrays' index, one per array


def send_parts(conn: socket.socket, parts: Sequence[bytes]) -> None:
    conn.sendall(struct.pack("<I", len(parts)))
    for part in parts:
        conn.sendall(struct.pack("<Q", len(part)))
        conn.sendall(part)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the worker connection closed mid-message")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_parts(conn: socket.socket, max_parts: int = MAX_PARTS) -> list[bytes]:
    (count,) = struct.unpack("<I", _recv_exact(conn, 4))
    if count > max_parts:
        raise ConnectionError(f"a frame of {count} parts; expected at most {max_parts}")
    return [_recv_exact(conn, struct.unpack("<Q", _recv_exact(conn, 8))[0]) for _ in range(count)]


def message_parts(msg: Any) -> list[bytes]:
    """`msg` as frame parts: its protobuf with every ArrayRecord emptied, a JSON index of the
    arrays (record, key, dtype, shape, stype), then each array's bytes as Flower holds them.
    Protobuf would copy a 69 MB global part three times on the way (0.6 s on a 2-core machine,
    each way); these go to the socket as they are."""
    from flwr.common import ArrayRecord, RecordDict, serde
    from flwr.proto.message_pb2 import Message as ProtoMessage

    index: list[list[Any]] = []
    data: list[bytes] = []
    content = RecordDict()
    if msg.has_content():
        for name, record in msg.content.items():
            if isinstance(record, ArrayRecord):
                for key, array in record.items():
                    index.append([name, key, array.dtype, list(array.shape), array.stype])
                    data.append(array.data)
                record = ArrayRecord()
            content[name] = record
    proto = ProtoMessage(
        metadata=serde.metadata_to_proto(msg.metadata),
        content=serde.recorddict_to_proto(content) if msg.has_content() else None,
        error=serde.error_to_proto(msg.error) if msg.has_error() else None,
    )
    return [proto.SerializeToString(), json.dumps(index).encode(), *data]


def _index_entry(entry: Any) -> bool:
    """Whether `entry` is [record, key, dtype, shape (ints), stype]."""
    if not (isinstance(entry, list) and len(entry) == 5 and isinstance(entry[3], list)):
        return False
    names = (entry[0], entry[1], entry[2], entry[4])
    return all(isinstance(x, str) for x in names) and all(type(d) is int for d in entry[3])


def message_from_parts(parts: Sequence[bytes]) -> Any:
    """The Message `message_parts` wrote; a malformed index or a count that does not match is a
    ValueError."""
    from flwr.common import Array, ArrayRecord, serde
    from flwr.proto.message_pb2 import Message as ProtoMessage

    if len(parts) < 2:
        raise ValueError("a message frame without its arrays' index")
    msg = serde.message_from_proto(ProtoMessage.FromString(parts[0]))
    index = json.loads(parts[1])
    if not isinstance(index, list) or len(index) != len(parts) - 2:
        raise ValueError("a message frame whose arrays do not match its index")
    for entry, data in zip(index, parts[2:], strict=True):
        if not _index_entry(entry):
            raise ValueError("a malformed entry in a message frame's arrays' index")
        name, key, dtype, shape, stype = entry
        record = msg.content.get(name) if msg.has_content() else None
        if not isinstance(record, ArrayRecord):
            raise ValueError(f"a message frame's array for {name!r}, which is no ArrayRecord")
        record[key] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=data)
    return msg
