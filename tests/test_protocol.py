"""deploy.protocol: the recorder of everything sent ($FEDJAX_SPLIT_FLOWER_RECORD), and the config
keys the server and the nodes exchange surviving Flower's own wire format (protobuf) as they are
(ints stay ints, lists stay lists, a metrics JSON with NaN stays readable).

Messages are built with explicit metadata, as the SuperLink would deliver them: no Flower process
is started."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, Metadata, MetricRecord, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto

from fedjax_split.deploy import protocol


def _message(content: RecordDict, kind: str, message_id: str = "m1") -> Message:
    metadata = Metadata(
        run_id=1, message_id=message_id, src_node_id=1, dst_node_id=7, reply_to_message_id="",
        group_id="", created_at=time.time(), ttl=3600.0, message_type=kind,
    )  # fmt: skip
    return Message(content, metadata=metadata)


def _over_the_wire(msg: Message) -> Message:
    """The message as the receiver gets it: Flower's protobuf, serialised and parsed back."""
    proto = message_to_proto(msg)
    back = type(proto)()
    back.ParseFromString(proto.SerializeToString())
    return message_from_proto(back)


def _train_message() -> Message:
    """A train message as the server builds it: fp16 bits of a global part, the round's config."""
    bits = np.arange(12, dtype=np.uint16).reshape(3, 4)
    config = {
        protocol.ROUND: 3, protocol.STATE_ROUND: 2, protocol.WIRE: "float16",
        protocol.RUN: "0123456789abcdef", protocol.KEEP_FROM: 1, protocol.CLIENT: 2,
        protocol.TRAINED: ["encoder/layer_0/output/bias", "embeddings/LayerNorm/scale"],
    }  # fmt: skip
    content = RecordDict({
        protocol.CONFIG: ConfigRecord(config),
        protocol.GLOBAL: ArrayRecord({"encoder/layer_0/output/kernel": Array(bits),
                                      "embeddings/LayerNorm/scale": Array(bits[0])}),
    })  # fmt: skip
    return _message(content, protocol.TRAIN)


def test_nothing_is_recorded_without_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(protocol.RECORD_ENV, raising=False)
    msg = _train_message()
    assert protocol.record_sent(msg, "server") is msg
    monkeypatch.setenv(protocol.RECORD_ENV, "")  # empty: off too
    assert protocol.record_sent(msg, "server") is msg
    assert list(tmp_path.iterdir()) == []


def test_every_array_and_key_sent_is_logged_per_sender_and_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = tmp_path / "sent" / "deeper"  # created on first use
    monkeypatch.setenv(protocol.RECORD_ENV, str(where))
    msg = _train_message()
    assert protocol.record_sent(msg, "server") is msg
    reply_content = RecordDict({
        protocol.CONFIG: ConfigRecord({protocol.CLIENT: 2, protocol.WIRE: "float16"}),
        protocol.METRICS: MetricRecord({protocol.LOSS_SUM: 1.5, protocol.LOSS_UNITS: 4.0,
                                        protocol.STEPS: 2, protocol.NUM_TRAIN: 32}),
        protocol.UPLOAD: ArrayRecord({"encoder/layer_0/output/kernel": Array(
            np.full((3, 4), 7, np.uint16))}),
    })  # fmt: skip
    protocol.record_sent(Message(reply_content, reply_to=msg), "client")
    protocol.record_sent(msg, "server")  # appended, not overwritten

    pid = os.getpid()
    assert sorted(p.name for p in where.iterdir()) == [f"client-{pid}.jsonl", f"server-{pid}.jsonl"]
    server = [json.loads(x) for x in (where / f"server-{pid}.jsonl").read_text().splitlines()]
    assert len(server) == 2 and server[0] == server[1]
    entry = server[0]
    assert entry["sender"] == "server" and entry["type"] == protocol.TRAIN
    bits = np.arange(12, dtype=np.uint16).reshape(3, 4)
    assert entry["arrays"] == [
        {"record": protocol.GLOBAL, "path": "encoder/layer_0/output/kernel", "dtype": "uint16",
         "shape": [3, 4], "sha256": hashlib.sha256(bits.tobytes()).hexdigest()},
        {"record": protocol.GLOBAL, "path": "embeddings/LayerNorm/scale", "dtype": "uint16",
         "shape": [4], "sha256": hashlib.sha256(bits[0].tobytes()).hexdigest()},
    ]  # fmt: skip
    assert entry["configs"] == {protocol.CONFIG: sorted(msg.content[protocol.CONFIG])}
    assert entry["metrics"] == {}
    (client,) = [json.loads(x) for x in (where / f"client-{pid}.jsonl").read_text().splitlines()]
    assert client["sender"] == "client" and client["type"] == protocol.TRAIN
    assert [(a["record"], a["path"]) for a in client["arrays"]] == [
        (protocol.UPLOAD, "encoder/layer_0/output/kernel")]  # fmt: skip
    assert client["arrays"][0]["sha256"] == hashlib.sha256(
        np.full((3, 4), 7, np.uint16).tobytes()).hexdigest()  # fmt: skip
    assert client["metrics"] == {protocol.METRICS: sorted(
        [protocol.LOSS_SUM, protocol.LOSS_UNITS, protocol.STEPS, protocol.NUM_TRAIN])}  # fmt: skip
    assert client["configs"] == {protocol.CONFIG: sorted([protocol.CLIENT, protocol.WIRE])}


def test_a_digest_changes_with_a_single_bit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(protocol.RECORD_ENV, str(tmp_path))
    for value in (0x3C00, 0x3C01):  # fp16 1.0 and its neighbour
        content = RecordDict({protocol.UPLOAD: ArrayRecord({"w": Array(
            np.asarray([value], np.uint16))})})  # fmt: skip
        protocol.record_sent(_message(content, protocol.TRAIN), "client")
    lines = (tmp_path / f"client-{os.getpid()}.jsonl").read_text().splitlines()
    first, second = (json.loads(x)["arrays"][0]["sha256"] for x in lines)
    assert first != second


def test_the_config_keys_survive_flowers_wire_format() -> None:
    """A train message and each kind of reply through protobuf: every key and value as sent."""
    msg = _train_message()
    back = _over_the_wire(msg)
    assert back.metadata.message_type == protocol.TRAIN
    assert dict(back.content[protocol.CONFIG]) == dict(msg.content[protocol.CONFIG])
    cfg = back.content[protocol.CONFIG]
    assert isinstance(cfg[protocol.ROUND], int) and isinstance(cfg[protocol.TRAINED], list)
    for path, array in msg.content[protocol.GLOBAL].items():
        got = back.content[protocol.GLOBAL][path].numpy()
        assert got.dtype == np.uint16 and got.tobytes() == array.numpy().tobytes()

    query_reply = {
        protocol.CLIENT: 2, protocol.SPLIT_TRAIN: [5, 0, 9], protocol.SPLIT_TEST: [3],
        protocol.SHARES: json.dumps([0.25, 0.75]), protocol.POOL_SIZE: 96,
        protocol.PARTITION: json.dumps({"scheme": "paper", "seed": 0}),
        protocol.TAG_NAMES: ["O", "B-pos", "I-pos"],
    }  # fmt: skip
    eval_reply = {protocol.CLIENT: 2, protocol.EVAL_JSON: json.dumps({"f1": math.nan, "n": 3})}
    for values in (query_reply, eval_reply):
        sent = _message(RecordDict({protocol.CONFIG: ConfigRecord(values)}), protocol.QUERY)
        got = dict(_over_the_wire(sent).content[protocol.CONFIG])
        assert got == values
    metrics = json.loads(str(eval_reply[protocol.EVAL_JSON]))
    assert math.isnan(metrics["f1"]) and metrics["n"] == 3  # NaN travels in the JSON
    train_metrics = {protocol.LOSS_SUM: 12.5, protocol.LOSS_UNITS: 32.0, protocol.STEPS: 2,
                     protocol.NUM_TRAIN: 32}  # fmt: skip
    sent = _message(RecordDict({protocol.METRICS: MetricRecord(train_metrics)}), protocol.TRAIN)
    got = dict(_over_the_wire(sent).content[protocol.METRICS])
    assert got == train_metrics and isinstance(got[protocol.STEPS], int)


def test_names_do_not_collide() -> None:
    """Two names for one key would silently overwrite a value in a record."""
    records = [protocol.GLOBAL, protocol.UPLOAD, protocol.CONFIG, protocol.METRICS]
    config_keys = [
        protocol.ROUND, protocol.STATE_ROUND, protocol.WIRE, protocol.CLIENT, protocol.RUN,
        protocol.KEEP_FROM, protocol.TRAINED, protocol.SPLIT_TRAIN, protocol.SPLIT_TEST,
        protocol.SHARES, protocol.POOL_SIZE, protocol.PARTITION, protocol.TAG_NAMES,
        protocol.EVAL_JSON, protocol.GLOBAL_EVAL, protocol.GLOBAL_EVAL_JSON, protocol.DP_CLIP,
        protocol.EVAL_ROUND,
    ]  # fmt: skip
    metric_keys = [protocol.LOSS_SUM, protocol.LOSS_UNITS, protocol.STEPS, protocol.NUM_TRAIN]
    node_keys = [protocol.PARTITION_ID, protocol.STATE_DIR, protocol.DATA_DIR]
    run_keys = [protocol.EXPERIMENT, protocol.ROUND_TIMEOUT, protocol.CONNECT_TIMEOUT,
                protocol.STATUS_FILE, protocol.STOP_AFTER_ROUND]  # fmt: skip
    kinds = [protocol.QUERY, protocol.TRAIN, protocol.EVALUATE]
    for names in (records, config_keys, metric_keys, node_keys, run_keys, kinds):
        assert len(set(names)) == len(names), names
