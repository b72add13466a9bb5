# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Study preset (docs/results.md): rotten tomatoes, MiniLM-L6, K=10, Table II label ramp.

Sized so that FedAvg learns and the study still runs on a 2-core CPU (docs/benchmarks.md has the
run times): 4,000 of the 12,808 snippets subsampled, exact Table II shares (3,120 used: 250
train + 62 test per client, the surplus of the majority class dropped), 10 rounds of 1 local
epoch, all clients every round. MiniLM-L6 has 6 layers: c = 3/4/5 stand for the paper's
6/8/10 of 12, c = 6 is FedAvg, c = 0 is local training only.

  python -m fedjax_split.train --config configs/study_rotten_tomatoes_k10.py --critical-layer 3 --output-dir runs/study/k10_fedsplit_c3
  python tools/reproduce.py   # every run of the study, then docs/results.md
"""


def get_config() -> dict:
    return dict(
        task="rotten_tomatoes",
        model="minilm-l6",
        algorithm="fedavg",
        critical_layer=3,
        clients=10,
        partition="paper",
        max_examples=4000,
        rounds=10,
        local_epochs=1,
        batch_size=16,
        lr=5e-5,
        max_length=64,
        chunk_size=1,  # on 2 CPU cores one client at a time inside the jit is fastest (docs/benchmarks.md)
        checkpoint_every=2,  # a study run resumes from its last checkpoint
        eval_every=1,
    )
