# ruff: noqa: E501  (the run commands in the docstring are kept on one line each)
r"""FedNLP's freezing study (Lin et al. 2022, Table 3): 20 Newsgroups, FedOpt, the embeddings and
the lowest layers frozen (neither trained nor sent), MiniLM-L6 in place of DistilBERT (both 6
layers). FedNLP, round 28: none 55.11, E 54.86, E+L0 52.91, E+L0-1 53.92, E+L0-2 52.01, E+L0-3
30.68, E+L0-4 16.63, E+L0-5 12.97. One run per row; the regexes match Hugging Face tensor names:

  python -m fedjax_split.train --config configs/fednlp_freezing.py --output-dir runs/freeze_none
  python -m fedjax_split.train --config configs/fednlp_freezing.py --freeze 'embeddings\.' --output-dir runs/freeze_E
  python -m fedjax_split.train --config configs/fednlp_freezing.py --freeze 'embeddings\.|encoder\.layer\.0\.' --output-dir runs/freeze_E_L0
  python -m fedjax_split.train --config configs/fednlp_freezing.py --freeze 'embeddings\.|encoder\.layer\.[0-1]\.' --output-dir runs/freeze_E_L0-1
  python -m fedjax_split.train --config configs/fednlp_freezing.py --freeze 'embeddings\.|encoder\.layer\.[0-2]\.' --output-dir runs/freeze_E_L0-2
  python -m fedjax_split.train --config configs/fednlp_freezing.py --freeze 'embeddings\.|encoder\.layer\.[0-3]\.' --output-dir runs/freeze_E_L0-3
  python -m fedjax_split.train --config configs/fednlp_freezing.py --freeze 'embeddings\.|encoder\.layer\.[0-4]\.' --output-dir runs/freeze_E_L0-4
  python -m fedjax_split.train --config configs/fednlp_freezing.py --freeze 'embeddings\.|encoder\.layer\.[0-5]\.' --output-dir runs/freeze_E_L0-5

FedNLP's regime: 100 clients, 10 per round, Dirichlet alpha 1, FedOpt (server SGD with momentum:
`fedavgm`), everything global (critical layer L). FedNLP reports round 28; `--rounds 28`.
"""


def get_config() -> dict:
    return dict(
        task="20news",
        model="minilm-l6",
        algorithm="fedavgm",
        critical_layer=None,
        clients=100,
        clients_per_round=10,
        partition="dirichlet",  # alpha 1, the default
        rounds=28,
        local_epochs=1,
        lr=5e-5,
    )
