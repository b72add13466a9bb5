# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Paper Table III: the nine GLUE tasks, K=3, Table I partition, bert-base-uncased; `:TASK` picks
the task. Every other setting is the default, which is the table's FedSplitBERT row (critical
layer L/2 = 6). Metrics: CoLA Matthews correlation, SST-2 accuracy and F1, MRPC F1 and accuracy, QQP,
QNLI and WNLI accuracy, MNLI matched / mismatched accuracy, RTE accuracy and F1, STS-B Pearson
(its partition sorts the scores). The rows of the table, per task:

  # cola
  python -m fedjax_split.train --config configs/table3.py:cola --output-dir runs/t3_cola_fedsplit
  python -m fedjax_split.train --config configs/table3.py:cola --quantize fp16 --output-dir runs/t3_cola_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:cola --critical-layer L --output-dir runs/t3_cola_fedavg
  python -m fedjax_split.train --config configs/table3.py:cola --critical-layer L --algorithm fedprox --output-dir runs/t3_cola_fedprox
  python -m fedjax_split.train --config configs/table3.py:cola --critical-layer L --algorithm fedadam --output-dir runs/t3_cola_fedadam
  # sst2
  python -m fedjax_split.train --config configs/table3.py:sst2 --output-dir runs/t3_sst2_fedsplit
  python -m fedjax_split.train --config configs/table3.py:sst2 --quantize fp16 --output-dir runs/t3_sst2_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:sst2 --critical-layer L --output-dir runs/t3_sst2_fedavg
  python -m fedjax_split.train --config configs/table3.py:sst2 --critical-layer L --algorithm fedprox --output-dir runs/t3_sst2_fedprox
  python -m fedjax_split.train --config configs/table3.py:sst2 --critical-layer L --algorithm fedadam --output-dir runs/t3_sst2_fedadam
  # mrpc
  python -m fedjax_split.train --config configs/table3.py:mrpc --output-dir runs/t3_mrpc_fedsplit
  python -m fedjax_split.train --config configs/table3.py:mrpc --quantize fp16 --output-dir runs/t3_mrpc_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:mrpc --critical-layer L --output-dir runs/t3_mrpc_fedavg
  python -m fedjax_split.train --config configs/table3.py:mrpc --critical-layer L --algorithm fedprox --output-dir runs/t3_mrpc_fedprox
  python -m fedjax_split.train --config configs/table3.py:mrpc --critical-layer L --algorithm fedadam --output-dir runs/t3_mrpc_fedadam
  # qqp
  python -m fedjax_split.train --config configs/table3.py:qqp --output-dir runs/t3_qqp_fedsplit
  python -m fedjax_split.train --config configs/table3.py:qqp --quantize fp16 --output-dir runs/t3_qqp_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:qqp --critical-layer L --output-dir runs/t3_qqp_fedavg
  python -m fedjax_split.train --config configs/table3.py:qqp --critical-layer L --algorithm fedprox --output-dir runs/t3_qqp_fedprox
  python -m fedjax_split.train --config configs/table3.py:qqp --critical-layer L --algorithm fedadam --output-dir runs/t3_qqp_fedadam
  # mnli
  python -m fedjax_split.train --config configs/table3.py:mnli --output-dir runs/t3_mnli_fedsplit
  python -m fedjax_split.train --config configs/table3.py:mnli --quantize fp16 --output-dir runs/t3_mnli_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:mnli --critical-layer L --output-dir runs/t3_mnli_fedavg
  python -m fedjax_split.train --config configs/table3.py:mnli --critical-layer L --algorithm fedprox --output-dir runs/t3_mnli_fedprox
  python -m fedjax_split.train --config configs/table3.py:mnli --critical-layer L --algorithm fedadam --output-dir runs/t3_mnli_fedadam
  # qnli
  python -m fedjax_split.train --config configs/table3.py:qnli --output-dir runs/t3_qnli_fedsplit
  python -m fedjax_split.train --config configs/table3.py:qnli --quantize fp16 --output-dir runs/t3_qnli_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:qnli --critical-layer L --output-dir runs/t3_qnli_fedavg
  python -m fedjax_split.train --config configs/table3.py:qnli --critical-layer L --algorithm fedprox --output-dir runs/t3_qnli_fedprox
  python -m fedjax_split.train --config configs/table3.py:qnli --critical-layer L --algorithm fedadam --output-dir runs/t3_qnli_fedadam
  # rte
  python -m fedjax_split.train --config configs/table3.py:rte --output-dir runs/t3_rte_fedsplit
  python -m fedjax_split.train --config configs/table3.py:rte --quantize fp16 --output-dir runs/t3_rte_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:rte --critical-layer L --output-dir runs/t3_rte_fedavg
  python -m fedjax_split.train --config configs/table3.py:rte --critical-layer L --algorithm fedprox --output-dir runs/t3_rte_fedprox
  python -m fedjax_split.train --config configs/table3.py:rte --critical-layer L --algorithm fedadam --output-dir runs/t3_rte_fedadam
  # wnli
  python -m fedjax_split.train --config configs/table3.py:wnli --output-dir runs/t3_wnli_fedsplit
  python -m fedjax_split.train --config configs/table3.py:wnli --quantize fp16 --output-dir runs/t3_wnli_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:wnli --critical-layer L --output-dir runs/t3_wnli_fedavg
  python -m fedjax_split.train --config configs/table3.py:wnli --critical-layer L --algorithm fedprox --output-dir runs/t3_wnli_fedprox
  python -m fedjax_split.train --config configs/table3.py:wnli --critical-layer L --algorithm fedadam --output-dir runs/t3_wnli_fedadam
  # stsb
  python -m fedjax_split.train --config configs/table3.py:stsb --output-dir runs/t3_stsb_fedsplit
  python -m fedjax_split.train --config configs/table3.py:stsb --quantize fp16 --output-dir runs/t3_stsb_fedsplit16
  python -m fedjax_split.train --config configs/table3.py:stsb --critical-layer L --output-dir runs/t3_stsb_fedavg
  python -m fedjax_split.train --config configs/table3.py:stsb --critical-layer L --algorithm fedprox --output-dir runs/t3_stsb_fedprox
  python -m fedjax_split.train --config configs/table3.py:stsb --critical-layer L --algorithm fedadam --output-dir runs/t3_stsb_fedadam

Paper Table IV is the same configs by critical layer c, one run per (task, c); c=12 is FedAvg
(everything global), c=0 local training only (nothing is sent). Average the primary metric of
summary.json over the 9 tasks to get the table's row; tools/plot.py draws the runs side by side:

  for c in 0 4 6 8 10 12; do
    python -m fedjax_split.train --config configs/table3.py:mrpc --critical-layer $c --output-dir runs/t4_mrpc_c$c
  done

Needs the hub (or --data-dir with the GLUE files). The paper tunes lr in 2e-5..5e-5, 3-9 local
epochs and batch 8/16/32 per task without listing the winners; the defaults are the cheap
standard end.
"""

from fedjax_split.run.settings import choose

TASKS = ("cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte", "wnli", "stsb")


def get_config(task: str) -> dict:
    return dict(task=choose(task, TASKS, "Table III task"))
