"""Tasks: what a task asks of the model and how its answers are scored.

`registry` names each task (its text fields, labels, objective, metrics and where its data comes
from); `objectives` gives each kind of output its head, loss and predictions (classification,
regression, token classification, masked LM); `metrics` and `bio` score predictions against
labels, a token task's as entities over BIO tags. Nothing here reads data or builds a model, so
data loading, models and the federated code can all depend on it.
"""
