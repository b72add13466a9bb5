# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Paper Table V: K=10 clients (Table II partition), accuracy on SST-2, MRPC, QQP and QNLI; `:TASK`
picks the task and with it the paper's rounds (SST-2 9, MRPC 6, QQP and QNLI 3).

  python -m fedjax_split.train --config configs/table5_k10.py:sst2 --output-dir runs/t5_sst2_fedsplit
  python -m fedjax_split.train --config configs/table5_k10.py:mrpc --output-dir runs/t5_mrpc_fedsplit
  python -m fedjax_split.train --config configs/table5_k10.py:qqp --output-dir runs/t5_qqp_fedsplit
  python -m fedjax_split.train --config configs/table5_k10.py:qnli --output-dir runs/t5_qnli_fedsplit

Baseline rows: add --critical-layer L [--algorithm fedprox|fedadam]; the +16-bit row: --quantize fp16.
"""

from fedjax_split.run.settings import choose

ROUNDS = {"sst2": 9, "mrpc": 6, "qqp": 3, "qnli": 3}


def get_config(task: str) -> dict:
    return dict(task=choose(task, ROUNDS, "Table V task"), clients=10, rounds=ROUNDS[task])
