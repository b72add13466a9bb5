"""fedjax_split: federated fine-tuning of BERT on non-IID clients (FedSplitBERT and baselines),
and federated further pre-training (FedBFPT).

The public API is imported lazily so that `import fedjax_split` stays cheap (no jax/transformers
import until a name is used), and importing it changes nothing in the process: the process
settings (malloc, compilation cache, CPU devices) are `fedjax_split.runtime`'s, applied by the
entry points.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # models
    "BertConfig": "fedjax_split.models.bert_config",
    "init_params": "fedjax_split.models.bert",
    "make_apply": "fedjax_split.models.bert",
    "load_pretrained": "fedjax_split.models.hf_checkpoint",
    "save_pretrained": "fedjax_split.models.hf_checkpoint",
    # tasks
    "get_task": "fedjax_split.tasks.registry",
    "CLASSIFICATION": "fedjax_split.tasks.objectives",
    "REGRESSION": "fedjax_split.tasks.objectives",
    "TOKEN_CLASSIFICATION": "fedjax_split.tasks.objectives",
    "MASKED_LM": "fedjax_split.tasks.objectives",
    # data
    "load_tokenizer": "fedjax_split.data.tokenization",
    "Batch": "fedjax_split.data.batch",
    "PackedBatch": "fedjax_split.data.batch",
    "Batching": "fedjax_split.data.batching",
    "client_batches": "fedjax_split.data.batching",
    "client_eval_batches": "fedjax_split.data.batching",
    "stack_clients": "fedjax_split.data.stacking",
    # the federated core
    "GLOBAL": "fedjax_split.fed.roles",
    "LOCAL": "fedjax_split.fed.roles",
    "FROZEN": "fedjax_split.fed.roles",
    "critical_layer_rule": "fedjax_split.fed.roles",
    "head_only_rule": "fedjax_split.fed.roles",
    "regex_rule": "fedjax_split.fed.roles",
    "freeze_rule": "fedjax_split.fed.roles",
    "partition": "fedjax_split.fed.roles",
    "split_params": "fedjax_split.fed.roles",
    "merge_params": "fedjax_split.fed.roles",
    "ClientSpec": "fedjax_split.fed.client",
    "default_client_optimizer": "fedjax_split.fed.client",
    "weighted_mean": "fedjax_split.fed.aggregation",
    "ServerState": "fedjax_split.fed.server",
    "init_server_state": "fedjax_split.fed.server",
    "server_update": "fedjax_split.fed.server",
    "server_optimizers": "fedjax_split.fed.server_optimizers",
    # simulation and runs
    "RoundSpec": "fedjax_split.sim.round_spec",
    "run_round": "fedjax_split.sim.rounds",
    "client_round": "fedjax_split.fed.client_program",
    "client_key": "fedjax_split.fed.client_program",
    "replicate": "fedjax_split.sim.rounds",
    "run_experiment": "fedjax_split.run.experiment",
    "run_pretraining": "fedjax_split.run.pretraining",
    "UserError": "fedjax_split.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedjax_split' has no attribute {name!r}")
    mod = importlib.import_module(module)
    return mod if module.endswith("." + name) else getattr(mod, name)
