"""Configuration of a federated further pre-training run (`python -m fedjax_split.pretrain`).

One frozen dataclass of sections; what it shares with `train`'s ExperimentConfig is written once
(`run.run_config`: the seed, --config, the run directory; the checkpoint and --freeze:
`run.model_section`; runtime and outputs: `run.runtime_sections`), and its flags, config files,
typing, choice checks and resume checks come from `run.settings`. Defaults are FedBFPT's released
setting (MISSION.md section 4): bert-base-uncased, 6 clients, 5 rounds of 1 epoch, AdamW lr 5e-5
with weight decay 0.01, batch 256, length 128, 15% masking, small models of L/2 layers, the
"halving" schedule.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedjax_split.data.text.corpus_split import SCHEMES
from fedjax_split.data.text.text_corpora import CORPORA, MODES, check_corpus_name
from fedjax_split.errors import UserError
from fedjax_split.fed.layerwise import LAYER_DRAWS, SCHEDULES, check_small_model, schedule_layers
from fedjax_split.run.model_section import Model, frozen_parameters
from fedjax_split.run.run_config import NON_TRAJECTORY, RunConfig, check_sections
from fedjax_split.run.runtime_sections import PretrainOutputs, PretrainRuntime
from fedjax_split.run.settings import (
    FEDERATION,
    MODEL,
    TASK,
    Schema,
    Section,
    as_given,
    section,
)
from fedjax_split.run.settings import setting as _setting
from fedjax_split.run.sites import check_site_dirs, implied_by_sites, refuse_with_sites
from fedjax_split.run.value_checks import (
    at_least_one,
    check_data_dir,
    check_regex,
    non_negative,
    positive_number,
    require,
)

# fedbfpt: one layer + the MLM head a round on small models (PL-SDL); bert-fl: FedAvg of the whole
# model; centralised: one client holding all the clients' text; truncated: the first k layers,
# trained whole, federatedly (DistilBERT/TinyBERT-style rows); none: no further pre-training.
METHODS = ("fedbfpt", "bert-fl", "centralised", "truncated", "none")
AGGREGATIONS = ("weighted", "unweighted")
# settings that split one corpus: with --site-data there is none to split
_CORPUS_ONLY = ("split", "sigma", "max_documents", "data_dir")


@dataclasses.dataclass(frozen=True)
class PretrainData(Section):
    """The text and how it is split into clients, held out and masked."""

    corpus: str = _setting(
        "pubmed",
        f"Text: {', '.join(CORPORA)} (local: *.txt under --data-dir; hub: a datasets name or "
        "local dir with a 'text' column).",
        group=TASK,
        metavar="CORPUS",
    )
    data_dir: str | None = _setting(
        None,
        "Directory with the corpus' files (local .txt, or MEDLINE .xml.gz).",
        metavar="DIR",
        group=TASK,
    )
    site_data: str | None = _setting(
        None,
        "Sites with their own text: DIR0,DIR1,... one directory per client, each holding *.txt "
        "read as --corpus local reads --data-dir: client k's text is exactly DIR_k's files (no "
        "split of one corpus), and each site holds out --heldout-fraction of its own documents "
        "for the held-out MLM figures. Implies --corpus local and --clients = the sites; "
        "--split, --sigma, --max-documents and --data-dir do not apply. On Flower (python -m "
        "fedjax_split.flower pretrain) SuperNode k reads DIR_k alone; `node-config`: each "
        "SuperNode reads the data-dir of its own node config (real sites, --write-app).",
        metavar="DIRS",
        group=TASK,
    )
    text_mode: str = _setting(
        "document",
        "document: each client's documents as one token stream cut into full sequences; line: "
        "one sequence per line, truncated.",
        choices=MODES,
        group=TASK,
    )
    split: str = _setting(
        "iid",
        "How documents are split over clients: iid, quantity (normal-distributed sizes), source "
        "(by file: PubMed's two baseline files).",
        choices=SCHEMES,
        group=TASK,
    )
    sigma: float = _setting(
        0.5,
        "Standard deviation of the relative client sizes for --split quantity.",
        group=TASK,
        metavar="SIGMA",
    )
    max_documents: int | None = _setting(
        None,
        "Subsample the corpus to this many documents first (CPU runs).",
        metavar="N",
        group=TASK,
    )
    heldout_fraction: float = _setting(
        0.05,
        "Share of the documents held out (on no client) for the MLM loss/accuracy; with "
        "--site-data, of each site's own documents (held out, and scored, where they live).",
        group=TASK,
        metavar="FRACTION",
    )
    max_length: int = _setting(
        128, "Tokens per sequence, [CLS] and [SEP] included.", group=TASK, metavar="TOKENS"
    )
    mlm_probability: float = _setting(
        0.15, "Share of tokens predicted per sequence.", group=TASK, metavar="P"
    )

    def check(self, config: Any) -> None:
        """The corpus's name, the lengths, counts and fractions, --data-dir; with --site-data,
        local text and none of the settings that split one corpus (they would be silently
        ignored); without, --corpus local needs --data-dir. The sites against the clients:
        `validate`."""
        check_corpus_name(self.corpus)
        require(config, "max_length", self.max_length >= 8, "at least 8")
        at_least_one(config, "max_documents")
        require(config, "mlm_probability", 0 < self.mlm_probability < 1, "in (0, 1)")
        require(config, "heldout_fraction", 0 < self.heldout_fraction < 1, "in (0, 1)")
        non_negative(config, "sigma")
        check_data_dir(config)
        if self.site_data is not None:
            if self.corpus != "local":
                raise UserError(
                    f"{as_given(config, 'corpus')} with --site-data: each site's text is its "
                    "*.txt files; pass --corpus local, or drop --site-data"
                )
            refuse_with_sites(config, _CORPUS_ONLY, "text is its own site's files, not split "
                              "from one corpus", "split one corpus")  # fmt: skip
        elif self.corpus == "local" and self.data_dir is None:
            raise UserError("--corpus local needs --data-dir DIR holding *.txt files (or "
                            "--site-data)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PretrainModel(Model):
    """The model (`Model`'s checkpoint), its depth for the truncated baseline and FedBFPT's
    small client models, frozen parameters."""

    small_layers: int | None = _setting(
        None, "Layers of a FedBFPT client's small model (default: L/2).", metavar="L_S", group=MODEL
    )
    truncated_layers: int | None = _setting(
        None,
        "The truncated baseline's model: the first LAYERS layers (default: L/2).",
        metavar="LAYERS",
        group=MODEL,
    )
    freeze: str | None = frozen_parameters(
        "the method trains", "'embeddings\\.|encoder\\.' trains the MLM head alone"
    )

    def check(self, config: Any) -> None:
        """The depths of at least 1 (at most the model's: `check_depth`), --freeze's regex."""
        at_least_one(config, "small_layers", "truncated_layers")
        check_regex(config, "freeze")


@dataclasses.dataclass(frozen=True)
class PretrainClient(Section):
    """How each client trains in a round."""

    local_epochs: int = _setting(
        1, "Epochs each client trains on its text per round.", group=FEDERATION, metavar="E"
    )
    batch_size: int = _setting(256, "Client mini-batch size (sequences).", group=MODEL, metavar="B")
    lr: float = _setting(5e-5, "Client AdamW learning rate.", group=MODEL, metavar="LR")
    weight_decay: float = _setting(
        0.01, "AdamW weight decay (not on biases and LayerNorm).", group=MODEL, metavar="DECAY"
    )

    def check(self, config: Any) -> None:
        """Counts of at least 1, a positive learning rate, a weight decay >= 0."""
        at_least_one(config, "local_epochs", "batch_size")
        positive_number(config, "lr")
        non_negative(config, "weight_decay")


@dataclasses.dataclass(frozen=True)
class PretrainFederation(Section):
    """The method, its clients and rounds, and FedBFPT's layer schedule."""

    method: str = _setting(
        "fedbfpt",
        "fedbfpt (one layer + MLM head a round, small client models), bert-fl (FedAvg of the "
        "whole model), centralised (one client, all text), truncated (the first "
        "--truncated-layers layers, trained whole), none (no further pre-training).",
        choices=METHODS,
        group=MODEL,
    )
    clients: int = _setting(
        6, "Number of clients K (all take part every round).", group=FEDERATION, metavar="K"
    )
    rounds: int = _setting(
        5,
        "Federated rounds (centralised: epochs over all the text).",
        group=FEDERATION,
        metavar="N",
    )
    aggregation: str = _setting(
        "weighted",
        "Server mean: weighted by the clients' sequences, or unweighted (the released code).",
        choices=AGGREGATIONS,
        group=FEDERATION,
    )
    schedule: str = _setting(
        "halving",
        "FedBFPT's trained layer per round: halving (the released code's: each layer about "
        "half the remaining rounds) or every (advance every --schedule-period rounds).",
        choices=SCHEDULES,
        group=MODEL,
    )
    schedule_period: int = _setting(
        1, "Rounds per layer for --schedule every.", group=MODEL, metavar="R"
    )
    layer_draw: str = _setting(
        "replacement",
        "How a FedBFPT client's deeper layers are drawn: replacement (sorted, a layer may repeat: "
        "the journal's and the released code's draw) or distinct (without replacement).",
        choices=LAYER_DRAWS,
        group=MODEL,
    )

    def check(self, config: Any) -> None:
        """The clients, rounds and the schedule's period: at least 1 (the schedule against the
        small model's depth: `check_depth`)."""
        at_least_one(config, "clients", "rounds", "schedule_period")


@dataclasses.dataclass(frozen=True)
class PretrainConfig(RunConfig):
    """Everything that defines a further pre-training run."""

    data: PretrainData = section(PretrainData)
    model: PretrainModel = section(PretrainModel)
    client: PretrainClient = section(PretrainClient)
    federation: PretrainFederation = section(PretrainFederation)
    runtime: PretrainRuntime = section(PretrainRuntime)
    outputs: PretrainOutputs = section(PretrainOutputs)

    def run_name(self) -> str:
        corpus = self.data.corpus.replace(":", "_").replace("/", "_")
        method, clients = self.federation.method, self.federation.clients
        return f"pretrain_{corpus}_{method}_K{clients}_s{self.seed}"


SCHEMA = Schema(PretrainConfig, NON_TRAJECTORY)
FIELDS = SCHEMA.fields


def resolve(
    file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None
) -> PretrainConfig:
    """Defaults <- config-file values <- explicit overrides, then `validate`. With --site-data
    DIR0,DIR1,... the corpus is local and the clients are the sites unless given."""
    overrides = implied_by_sites(file_values, overrides, corpus="local")
    return SCHEMA.resolve(file_values, overrides, validate)


def validate(config: PretrainConfig) -> None:
    """Checks that need neither data nor model (`check_depth` needs the model's depth): the
    choices, each section's own values (its `check`), then the one rule between sections:
    --site-data names one existing directory per client (`run.sites.check_site_dirs`)."""
    check_sections(SCHEMA, config)
    check_site_dirs(config)


def check_depth(config: PretrainConfig, num_layers: int) -> tuple[int, int]:
    """(small model layers L_s, truncated layers k) for an L-layer model; UserError when the
    settings cannot work with it (the schedule's layers must fit the small model)."""
    model_cfg, fed = config.model, config.federation
    half = max(1, num_layers // 2)
    small = half if model_cfg.small_layers is None else model_cfg.small_layers
    k = half if model_cfg.truncated_layers is None else model_cfg.truncated_layers
    if fed.method == "fedbfpt":
        layers = schedule_layers(fed.schedule, fed.rounds, fed.schedule_period)
        check_small_model(layers, num_layers, small)
    if fed.method == "truncated" and not 1 <= k <= num_layers:
        raise UserError(
            f"{as_given(config, 'truncated_layers')} is outside 1..{num_layers} for this "
            f"{num_layers}-layer model; pass --truncated-layers with a value in 1..{num_layers}"
        )
    return small, k
