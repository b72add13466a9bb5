# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
"""Study presets (docs/results.md): rotten tomatoes, MiniLM-L6; `:k10` is K=10 with Table II's
label ramp, `:k3` K=3 with Table I's "other" row (80/20, 50/50, 20/80). Nothing else differs.

Sized so that FedAvg learns and the study still runs on a 2-core CPU: 4,000 of the 12,808
snippets subsampled, exact label shares (the surplus of the majority class dropped; K=10 uses
3,120: 250 train + 62 test per client, K=3 3,429: 914 train + 229 test per client), 10 rounds of
1 local epoch, all clients every round, a checkpoint every 2 rounds for a study run to resume
from. MiniLM-L6 has 6 layers: c = 3/4/5 stand for the paper's 6/8/10 of 12, c = 6 is FedAvg,
c = 0 is local training only.

  python -m fedjax_split.train --config configs/study_rotten_tomatoes.py:k10 --output-dir runs/study/k10_fedsplit_c3
  python -m fedjax_split.train --config configs/study_rotten_tomatoes.py:k3 --output-dir runs/study/k3_fedsplit_c3
  python tools/reproduce.py   # every run of the study, then docs/results.md
"""

from fedjax_split.run.settings import choose

CLIENTS = {"k10": 10, "k3": 3}


def get_config(clients: str) -> dict:
    return dict(
        task="rotten_tomatoes",
        model="minilm-l6",
        critical_layer=3,
        clients=CLIENTS[choose(clients, CLIENTS, "study preset")],
        max_examples=4000,
        local_epochs=1,
        lr=5e-5,
        max_length=64,
        chunk_size=1,  # on 2 CPU cores one client at a time inside the jit is fastest (docs/benchmarks.md)
        checkpoint_every=2,
    )
