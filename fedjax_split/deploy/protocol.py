"""What the ServerApp and the ClientApp say to each other: message kinds, record names, config
keys, and a recorder of everything sent (so tests can inspect what crossed the wire).

Three kinds of message, each answered by one reply:
- query: "who are you?" -> the node's client id and its split (pool indices, sizes, tag names);
- train: the global part in the wire dtype (+ round, wire dtype, run id, and with client-level
  DP the round's clip norm) -> the client's upload of its trained global part in the wire dtype
  (its update clipped, with DP) and its training metrics (with DP, its update's norm before
  clipping). Its local part stays on the node's disk;
- evaluate: the new global part -> the client's metrics on its own test split.
With --secure-aggregation the train message also carries the round's SecAgg+ settings and its
reply the client's public keys instead of its upload; three queries follow (`secagg_share`,
`secagg_mask`, `secagg_unmask`: `deploy.secure_round`), the masked vector in the second reply.

One exchange a round where evaluation is due before the last round: round r's evaluation rides in
round r+1's train message (`EVAL_ROUND` = r; the global part round r+1 sends is the server state
after round r, which round r's evaluation scores), and the reply carries both the client's
metrics and its upload. A client due to evaluate but not sampled in round r+1 gets an evaluate
message in the same exchange; the last round's evaluation goes on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fedjax_split.run.sites import NODE_SITES

QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"

GLOBAL = "global"  # ArrayRecord: the global part as sent (codec.encode)
UPLOAD = "upload"  # ArrayRecord: a client's trained global part as sent
CONFIG = "config"  # ConfigRecord: the keys below
METRICS = "metrics"  # MetricRecord: training metrics

# ConfigRecord keys
ROUND = "round"  # the round being run, 1-based
STATE_ROUND = "state-round"  # rounds the server state has completed (the keys fold it in)
WIRE = "wire-dtype"
CLIENT = "client-id"
RUN = "run-id"  # our run's id (survives a server restart), not Flower's run id
KEEP_FROM = "keep-from"  # the oldest kept checkpoint's round: parts none of them needs may go
TRAINED = "trained"  # the trained global paths, when a schedule chooses (absent: all)
DP_CLIP = "dp-clip"  # client-level DP: the round's clip norm, the client clips its update to it
EVAL_ROUND = "eval-round"  # train: evaluate after this round (ROUND - 1) first, then train
SPLIT_TRAIN, SPLIT_TEST = "train", "test"  # a node's pool indices (query reply)
SHARES = "shares"  # a node's realised label shares, JSON (query reply; null: none to report)
POOL_SIZE = "pool-size"
PARTITION = "partition"  # the partition's settings as JSON (scheme, seed, sizes, ...)
TAG_NAMES = "tag-names"
CLIENTS = "client-ids"  # query reply: the node's clients, each with a record `client_record(id)`
EVAL_JSON = "metrics-json"  # evaluate reply: the client's metrics as JSON (NaN allowed)
# evaluate: also score the global model (the global part with the initial local part; a split
# run's last evaluation), its metrics in the reply as GLOBAL_EVAL_JSON
GLOBAL_EVAL, GLOBAL_EVAL_JSON = "global-eval", "global-metrics-json"

# MetricRecord keys of a train reply
LOSS_SUM, LOSS_UNITS, STEPS, NUM_TRAIN = "loss-sum", "loss-units", "steps", "num-train"
SECAGG = "secagg"  # ConfigRecord: secure aggregation's settings (TRAIN) or a stage's payload
MASKED = "masked"  # ArrayRecord: a node's masked vector (uint64) under "masked"
# secure aggregation's three queries after TRAIN (message type "query.<stage>")
SECAGG_SHARE, SECAGG_MASK, SECAGG_UNMASK = "secagg_share", "secagg_mask", "secagg_unmask"
SECAGG_STAGES = (SECAGG_SHARE, SECAGG_MASK, SECAGG_UNMASK)
UPDATE_NORM = "update-norm"  # DP: the update's L2 norm before the client clipped it

# Node config keys (flower-supernode --node-config)
PARTITION_ID = "partition-id"
PARTITION_IDS = "partition-ids"  # several clients on one SuperNode: "0-33" or "0,4,7-9"
STATE_DIR = "state-dir"
DATA_DIR = "data-dir"

# Run config keys (the Flower App's [tool.flwr.app.config], flwr run --run-config)
EXPERIMENT = "experiment"  # the resolved ExperimentConfig as JSON
ROUND_TIMEOUT = "round-timeout"
CONNECT_TIMEOUT = "connect-timeout"
STATUS_FILE = "status-file"
STOP_AFTER_ROUND = "stop-after-round"

# Further pre-training (FedBFPT and its federated baselines; `deploy.pretrain_server`): its
# messages are "query.pretrain", "train.pretrain" and "evaluate.pretrain" (Flower's action names)
# and the run config says so
PRETRAIN = "pretrain"  # the messages' action, and the run config's kind
KIND = "kind"  # run config: "pretrain" for further pre-training (absent: fine-tuning)
PRETRAIN_CONFIG = "pretrain-config"  # run config: the resolved PretrainConfig as JSON
LAYERS = "layers"  # train: the global layer at each position of the client's model
DEPTH = "depth"  # evaluate: the layers of the model evaluated
PART, PARTS = "part", "parts"  # evaluate: score the held-out batches i with i % parts == part
SEQUENCES = "sequences"  # query and train replies: the node's training sequences
SPLIT_JSON = "split-json"  # query reply: the corpus split as the node derives it, JSON
HELDOUT_BATCHES = "heldout-batches"  # query reply: how many held-out batches there are
HELDOUT = "heldout"  # evaluate reply's ArrayRecord: "batches" (indices), "sums" [n, 3]
# MetricRecord keys of a train.pretrain reply (besides STEPS); a fine-tuning train reply carries
# FLOPS (and BERT_FL_FLOPS with a layer schedule: run.costs)
TRAIN_LOSS, TOKENS, FLOPS = "train-loss", "tokens", "flops"
BERT_FL_FLOPS, SECONDS, CPU_SECONDS = "bert-fl-flops", "seconds", "cpu-seconds"
# a fine-tuning TRAIN reply's FLOP counts, by their name in a round's record (run.costs)
COSTS = {"flops": FLOPS, "bert_fl_flops": BERT_FL_FLOPS}

# tests: "ROUND:STAGE:CLIENT,...": the node's worker dies as it gets that stage's message, as a
# site killed after sharing its keys would
SECAGG_DROP_ENV = "FEDJAX_SPLIT_TEST_SECAGG_DROP"
RECORD_ENV = "FEDJAX_SPLIT_FLOWER_RECORD"  # a directory: every message sent is logged there


def experiment_values(run_config: Any, key: str = EXPERIMENT) -> dict[str, Any]:
    """The run's settings (`EXPERIMENT`, or further pre-training's `PRETRAIN_CONFIG`) as the
    ServerApp and a ClientApp resolve them. With --site-data the sites' paths, were they there,
    are no one's business but their own site's: the server and every node see `node-config`
    (each node's data-dir is its site), so that neither looks at another site's directory."""
    values = json.loads(str(run_config[key]))
    if values.get("site_data") is not None:
        values["site_data"] = NODE_SITES
    return dict(values)


def record_sent(message: Any, sender: str) -> Any:
    """Logs what `message` carries (every array's record, path, dtype, shape and sha256 of its
    bytes; every config and metric key, and the configs' values) to
    $FEDJAX_SPLIT_FLOWER_RECORD/<sender>-<pid>.jsonl when that is set; returns the message.
    Called on the Message object handed to Flower, so nothing that is sent escapes it."""
    where = os.environ.get(RECORD_ENV)
    if not where:
        return message
    content = message.content
    arrays = []
    for rec_name, record in content.array_records.items():
        for path, array in record.items():
            arrays.append(
                {
                    "record": rec_name,
                    "path": path,
                    "dtype": array.dtype,
                    "shape": list(array.shape),
                    "sha256": hashlib.sha256(array.numpy().tobytes()).hexdigest(),
                }
            )
    entry = {
        "sender": sender,
        "type": message.metadata.message_type,
        "arrays": arrays,
        "configs": {k: sorted(r) for k, r in content.config_records.items()},
        # their values too, as text: what a test checks a node is never sent (DP's secret)
        "config_values": {k: {key: str(v) for key, v in r.items()}
                          for k, r in content.config_records.items()},
        "metrics": {k: sorted(r) for k, r in content.metric_records.items()},
    }
    Path(where).mkdir(parents=True, exist_ok=True)
    with open(Path(where) / f"{sender}-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    return message


def client_record(client: int) -> str:
    """The query reply's record of one of the node's clients (its id, split and sizes)."""
    return f"client-{int(client)}"
