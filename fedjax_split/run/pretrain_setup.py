"""What a further pre-training run holds in memory (`Setup`), built before anything is written:
the start model with its MLM head, the masking, the text (`run.pretrain_text`), the server
state, FedBFPT's schedule, --freeze's paths; the model the run produces (`final_params`)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax

from fedjax_split.data import tokenization
from fedjax_split.data.text import masking
from fedjax_split.errors import UserError
from fedjax_split.fed import algorithms, client, layerwise, roles
from fedjax_split.fed.server import init_server_state
from fedjax_split.fed.strategy import Sampling, Strategy
from fedjax_split.fed.wire import cast_from_wire
from fedjax_split.models import hf_checkpoint
from fedjax_split.run.pretrain_config import (
    PretrainConfig,
    check_depth,
    validate,
)
from fedjax_split.run.pretrain_text import client_text
from fedjax_split.run.value_checks import fits_positions
from fedjax_split.sim.pretrain_rounds import Trainer


@dataclasses.dataclass
class Setup:
    """What a run needs in memory, built before anything is written."""

    config: PretrainConfig
    model_config: Any  # the global model's BertConfig (head "mlm")
    model_dir: Path
    small_layers: int
    truncated_layers: int
    split: Any  # data.text.corpus_split.CorpusSplit, or SitesSplit (--site-data)
    clients: list[int]  # who trains: 0..K-1, or [0] holding all the text (centralised)
    sequences: list[Any]  # per training client: data.text.text_corpora.Sequences
    sizes: list[int]  # per training client: its sequences (the weights; Flower: as nodes report)
    heldout: list[Any]  # masked held-out batches
    masking: Any
    pad_id: int
    trainer: Trainer
    strategy: Strategy  # each round's plan and the server's step (`strategy`)
    server_state: Any
    schedule: list[int]  # FedBFPT's trained layer per round (index 0 = round 1)
    frozen: frozenset[str]  # --freeze: never trained nor sent


def check(config: PretrainConfig) -> tuple[int, int]:
    """Cheap checks against the model's depth (reads only its config.json): (L_s, k)."""
    validate(config)
    model_config = hf_checkpoint.load_config(hf_checkpoint.resolve_model(config.model.name))
    fits_positions(config, model_config.max_position_embeddings)
    return check_depth(config, model_config.num_hidden_layers)


def load_model(config: PretrainConfig) -> Any:
    """The start model with its MLM head (`hf_checkpoint.Pretrained`)."""
    return hf_checkpoint.load_pretrained(
        config.model.name, num_labels=2, seed=config.seed, dtype=config.runtime.dtype, head="mlm"
    )


def masking_spec(config: PretrainConfig, tokenizer: Any, model_config: Any) -> Any:
    """The MLM masking of `tokenizer`; UserError when its vocabulary outgrows the model's."""
    spec = masking.spec_from_tokenizer(tokenizer, config.data.mlm_probability)
    if spec.vocab_size > model_config.vocab_size:
        raise UserError(
            f"the tokenizer has {spec.vocab_size} tokens, the model's vocabulary "
            f"{model_config.vocab_size}; use the model's own tokenizer"
        )
    return spec


def make_trainer(config: PretrainConfig, model_config: Any) -> Any:
    """What the clients run (`sim.pretrain_rounds.Trainer`), with FedAvg at the server."""
    optimizer = client.default_client_optimizer(config.client.lr, config.client.weight_decay)
    return Trainer(model_config, optimizer, algorithms.server_optimizer("fedavg"))


def strategy(
    config: PretrainConfig, trainer: Trainer, params: Any, schedule: list[int],
    frozen: frozenset[str], clients: list[int], small_layers: int, depth: int,
) -> Strategy:  # fmt: skip
    """Further pre-training's algorithm, fine-tuning's `fed.strategy.Strategy` with a layer-wise
    plan: every client each round (`clients`: 0..K-1, or [0] centralised); FedBFPT trains round
    r's scheduled layer and the MLM head, each client on its own small model around it
    (`fed.layerwise.fedbfpt_plan`); the others train all of the first `depth` layers. --freeze's
    paths are never trained nor sent. The server's step is FedAvg's mean of those paths."""
    fed = config.federation
    # the paths alone: the closures must not keep the start model alive for the whole run
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    if fed.method == "fedbfpt":

        def plan(r: int, sampled: Any) -> layerwise.Plan:
            return layerwise.fedbfpt_plan(
                params, layer=schedule[r - 1], round_=r, clients=[int(c) for c in sampled],
                seed=config.seed, small_layers=small_layers, draw=fed.layer_draw,
            )  # fmt: skip
    else:

        def plan(r: int, sampled: Any) -> layerwise.Plan:
            return layerwise.full_plan(params, clients=list(sampled), depth=depth)

    @functools.lru_cache(maxsize=4)  # a round's plan is asked for 2-3 times (spec, layers, bytes)
    def cached(r: int, sampled: tuple[int, ...]) -> layerwise.Plan:
        return plan(r, sampled)

    return Strategy(
        sampling=Sampling(clients=len(clients), per_round=None, seed=config.seed),
        round_spec_for=lambda r: trainer.server_spec(cached(r, tuple(clients)).trained - frozen),
        layers_for=lambda r, sampled: cached(r, tuple(int(c) for c in sampled)).layers,
    )


def build(config: PretrainConfig) -> Setup:
    """Load the text and the model, split, tokenise, initialise. Writes nothing but caches."""
    pre = load_model(config)
    tokenizer = tokenization.load_tokenizer(pre.model_dir)
    spec = masking_spec(config, tokenizer, pre.config)
    split, clients, seqs, heldout = client_text(config, tokenizer, spec)
    sizes = [int(s.input_ids.shape[0]) for s in seqs]
    return dataclasses.replace(
        model_setup(config, pre, split, clients, sizes),
        sequences=seqs, heldout=heldout, masking=spec, pad_id=int(tokenizer.pad_token_id),
    )  # fmt: skip


def model_setup(
    config: PretrainConfig, pre: Any, split: Any, clients: list[int], sizes: list[int]
) -> Setup:
    """The run's Setup without text (Flower's server holds none): the model, the server state,
    the schedule, --freeze; `split` and `sizes` (each client's sequences) as given."""
    model_cfg, fed = config.model, config.federation
    small, k = check(config)
    # --freeze chooses parameters by their Hugging Face names, as fine-tuning's does
    frozen = (
        roles.paths_where(
            pre.params, roles.name_filter(model_cfg.freeze, hf_checkpoint.tensor_names(pre.config))
        )
        if model_cfg.freeze
        else frozenset()
    )
    if fed.method != "none":  # round 1 trains layer 0 (FedBFPT) or everything
        first = [0] if fed.method == "fedbfpt" else None
        if not layerwise.trained_paths(pre.params, first) - frozen:
            raise UserError(f"--freeze {model_cfg.freeze!r} leaves nothing to train; loosen it")
    trainer = make_trainer(config, pre.config)
    schedule = (
        layerwise.schedule_layers(fed.schedule, fed.rounds, fed.schedule_period)
        if fed.method == "fedbfpt"
        else []
    )
    depth = k if fed.method == "truncated" else pre.config.num_hidden_layers
    return Setup(
        config=config, model_config=pre.config, model_dir=Path(pre.model_dir),
        small_layers=small, truncated_layers=k, split=split, clients=clients, sequences=[],
        sizes=list(sizes), heldout=[], masking=None, pad_id=0, trainer=trainer,
        strategy=strategy(config, trainer, pre.params, schedule, frozen, clients, small, depth),
        server_state=init_server_state(pre.params, trainer.server_optimizer, "float32"),
        schedule=schedule, frozen=frozen,
    )  # fmt: skip


def model_depth(setup: Setup) -> int:
    """Layers of the model the run produces: k for the truncated baseline, else L."""
    if setup.config.federation.method == "truncated":
        return setup.truncated_layers
    return setup.model_config.num_hidden_layers


def final_params(setup: Setup) -> tuple[Any, Any]:
    """(params, BertConfig) of the model the run produces, from the server's state."""
    params = cast_from_wire(setup.server_state.global_params)
    depth = model_depth(setup)
    return layerwise.assemble(params, range(depth)), setup.trainer.depth_config(depth)
