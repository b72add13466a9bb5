"""fedjax_split: federated fine-tuning of BERT on non-IID clients (FedSplitBERT and baselines).

The public API is imported lazily so that `import fedjax_split` stays cheap (no jax/transformers
import until a name is used).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BertConfig": "fedjax_split.model",
    "init_params": "fedjax_split.model",
    "make_apply": "fedjax_split.model",
    "load_pretrained": "fedjax_split.hf_checkpoint",
    "save_pretrained": "fedjax_split.hf_checkpoint",
    "load_tokenizer": "fedjax_split.tokenization",
    "split_params": "fedjax_split.splitting",
    "merge_params": "fedjax_split.splitting",
    "server_optimizers": "fedjax_split.server_optimizers",
    "get_task": "fedjax_split.tasks",
    "UserError": "fedjax_split.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fedjax_split' has no attribute {name!r}")
    mod = importlib.import_module(module)
    return mod if module.endswith("." + name) else getattr(mod, name)
