# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Paper Table III, WNLI (accuracy), K=3, Table I partition.

The defaults below are the FedSplitBERT row (critical layer 6). The other rows of the table:

  python -m fedjax_split.train --config configs/table3_wnli.py --output-dir runs/t3_wnli_fedsplit
  python -m fedjax_split.train --config configs/table3_wnli.py --quantize fp16 --output-dir runs/t3_wnli_fedsplit16
  python -m fedjax_split.train --config configs/table3_wnli.py --critical-layer L --output-dir runs/t3_wnli_fedavg
  python -m fedjax_split.train --config configs/table3_wnli.py --critical-layer L --algorithm fedprox --output-dir runs/t3_wnli_fedprox
  python -m fedjax_split.train --config configs/table3_wnli.py --critical-layer L --algorithm fedadam --output-dir runs/t3_wnli_fedadam

Needs the hub (or --data-dir with the GLUE files). The paper tunes lr in 2e-5..5e-5, 3-9 local
epochs and batch 8/16/32 per task without listing the winners; these are the cheap standard end.
"""


def get_config() -> dict:
    return dict(
        task="wnli",
        model="bert-base-uncased",
        algorithm="fedavg",
        critical_layer=6,
        clients=3,
        partition="paper",
        rounds=10,
        local_epochs=3,
        batch_size=16,
        lr=2e-5,
        max_length=128,
    )
