"""Assembling one client's personalised model, and writing it as a Hugging Face directory or a
PEFT adapter: the work of `python -m fedjax_split.export` (whose docstring says what the model
is), as functions for Python and notebooks (`fedjax_split.export` re-exports them)."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from fedjax_split.deploy import node
from fedjax_split.errors import UserError
from fedjax_split.fed.roles import flatten_paths, merge_params, unflatten_paths
from fedjax_split.fed.wire import cast_from_wire
from fedjax_split.models import hf_checkpoint, hf_hub, lora
from fedjax_split.models import peft as peft_export
from fedjax_split.models.bert import Params
from fedjax_split.models.bert_config import BertConfig
from fedjax_split.run import outputs
from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir
from fedjax_split.run.experiment import CLIENTS_DIR
from fedjax_split.sim.client_store import ClientStore, load_tree, tree_digest

Model = tuple[Params, BertConfig, str]  # a client's parameters, architecture, base model's dir
__all__ = ["export_client", "peft_base", "personalised_params", "site_params", "skew_note"]


def personalised_params(run_dir: str | Path, client: int, round_: int | None = None) -> Model:
    """(params, BertConfig, model_dir) of client `client` from the run's checkpoint."""
    if not Path(run_dir).is_dir():
        raise UserError(f"{str(run_dir)!r} is not a directory; pass --run-dir of a train run")
    ck = RunCheckpointer(checkpoint_dir(run_dir))
    if round_ is None and ck.latest_round() is None:
        raise UserError(
            f"{str(run_dir)!r} has no checkpoint to export from; export a run that finished a "
            "checkpointed round (see --checkpoint-every)"
        )
    state, meta = ck.restore_untyped(round_)
    num_clients = len(meta["partition"])
    if not 0 <= client < num_clients:
        raise UserError(f"--client {client} is outside 0..{num_clients - 1} for this run")
    launcher = meta.get("deploy") == "flower"
    if launcher:
        store = _launcher_store(Path(run_dir), str(meta["run_id"]), client)
    else:
        store = ClientStore(Path(run_dir) / CLIENTS_DIR)
    r = int(meta["round"])
    initial = (store.directory / "initial.npz").is_file()  # the pretrained local part
    if not launcher and not initial:
        raise UserError(f"{str(run_dir)!r} has no client store ({CLIENTS_DIR}/) to export from")
    if launcher and not initial and store.version(client, r) is None:
        # a node keeps it only while a kept checkpoint needs it (`deploy.node.keep_initial`)
        raise UserError(f"client {client} had not trained by round {r} and its node kept no "
                        "pretrained part; export a later round (--round)")  # fmt: skip
    local = store.load(client, at_most=r)
    # the frozen part, when there is one, is the run's one copy (`run.checkpoint`'s per_run)
    return _assemble(state["server_state"]["global_params"], local, state.get("frozen", {}), meta)


def _assemble(global_wire: Params, local: Params, frozen: Params, meta: dict[str, Any]) -> Model:
    """(params, BertConfig, model_dir): the global part as the client received it (cast to fp32)
    merged with its local and the frozen part, the model as `pieces.model_meta` describes it."""
    params = merge_params(cast_from_wire(global_wire, jnp.float32), local, frozen)
    config = lora.from_fields(BertConfig.from_hf_dict(meta["model_config"]), meta.get("lora"))
    return params, config, meta["model_dir"]


def _launcher_store(run_dir: Path, run_id: str, client: int) -> ClientStore:
    """The client store of the node that holds `client` in a run of the local launcher
    (`python -m fedjax_split.flower`), which keeps each node's state dir under the run."""
    nodes = sorted((run_dir / "flower" / "nodes").glob(f"*/{run_id}"))
    for d in nodes:
        if (d / f"client_{client}").is_dir():
            return ClientStore(d)
    raise UserError(
        f"client {client}'s local part is not under {run_dir / 'flower' / 'nodes'}: a Flower "
        "run's personal parts stay on their nodes; export it at its site with --state-dir"
        + ("" if nodes else " (this run's nodes kept their state elsewhere)")
    )


def site_params(
    state_dir: str | Path, client: int, run_id: str | None = None, round_: int | None = None
) -> Model:
    """(params, BertConfig, model_dir) of client `client` at a Flower site, from the node's state
    dir alone: the global part the node last received (after round r), the client's local part
    after round r (`deploy.node.keep_for_export`) and the frozen part (from the node's model
    directory, checked against the sha256 the node recorded)."""
    d = _site_run(Path(state_dir), run_id)
    if not (d / f"client_{client}").is_dir() or not (d / node.MODEL_FILE).is_file():
        raise UserError(f"client {client} has not been evaluated at this node ({d}); pass one "
                        "of its clients, after a round that evaluated")  # fmt: skip
    global_wire, local, r = node.exported_pair(d, client)
    if round_ is not None and round_ != r:
        raise UserError(f"this node holds the global part after round {r} only; drop --round")
    meta = json.loads((d / node.MODEL_FILE).read_text())
    if (d / node.FROZEN_FILE).is_file():  # a node without a model directory to name copies it
        frozen = load_tree(d / node.FROZEN_FILE)
    elif node.FROZEN_DIGEST in meta:
        frozen = _rebuilt_frozen(meta, global_wire, local, meta[node.FROZEN_DIGEST])
    else:
        frozen = {}
    return _assemble(global_wire, local, frozen, meta)


def _rebuilt_frozen(meta: dict[str, Any], global_wire: Any, local: Any, digest: str) -> Any:
    """The frozen part a node named rather than copied: the parameters the run's model directory
    and seed give (`hf_checkpoint.rebuild_params`) that are neither global nor local, checked
    against the sha256 the node recorded (a base model changed since is a one-line error)."""
    model_dir = Path(meta["model_dir"])
    config = lora.from_fields(BertConfig.from_hf_dict(meta["model_config"]), meta.get("lora"))
    try:
        with warnings.catch_warnings():  # the fresh head's note: the run's own head replaces it
            warnings.simplefilter("ignore")
            params = hf_checkpoint.rebuild_params(model_dir, config, int(meta["seed"]))
    except UserError as e:
        raise UserError(f"this node reads the run's frozen weights from its model: {e}") from None
    taken = set(flatten_paths(global_wire)) | set(flatten_paths(local))
    frozen = unflatten_paths({p: np.asarray(x) for p, x in flatten_paths(params).items()
                              if p not in taken})  # fmt: skip
    if tree_digest(frozen) != digest:
        raise UserError(
            f"the frozen weights rebuilt from {str(model_dir)!r} are not the run's (their "
            "sha256 differs): the base model there is not the one this run trained on, or the "
            "JAX now installed draws the run's seeded tensors (a head or pooler the checkpoint "
            "lacked) otherwise; put the run's model back there, with the JAX version it trained "
            "with, to export"
        )
    return frozen


def _site_run(state_dir: Path, run_id: str | None) -> Path:
    """The run's directory under a node's state dir (the only run there when `run_id` is None)."""
    if not state_dir.is_dir():
        raise UserError(f"{str(state_dir)!r} is not a directory; pass the node's state-dir")
    if run_id is not None:
        if not (state_dir / run_id).is_dir():
            raise UserError(f"{state_dir} holds no run {run_id!r}; see its subdirectories")
        return state_dir / run_id

    runs = sorted(d.name for d in state_dir.iterdir() if (d / node.MODEL_FILE).is_file())
    if len(runs) != 1:
        raise UserError(
            f"{state_dir} holds {'no run' if not runs else 'runs ' + ', '.join(runs)}; "
            + ("pass the node's state-dir" if not runs else "pass --run-id")
        )
    return state_dir / runs[0]


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def export_client(
    run_dir: str | Path | None,
    client: int,
    out_dir: str | Path,
    round_: int | None = None,
    *,
    peft: bool = False,
    state_dir: str | Path | None = None,
    run_id: str | None = None,
    base_model: str | None = None,
    overwrite: bool = False,
    say: Callable[[str], None] = _say,
) -> Path:
    """Writes client `client`'s model to `out_dir`: a Hugging Face model directory (a LoRA run's
    adapters merged into their layers), or with `peft` the client's LoRA adapters and head as a
    PEFT adapter directory for the run's base model (`base_model`: its name there; default: the
    model's hub id when the run started from one, `peft_base`), each with the base's tokenizer.
    From a run directory (simulated, or made by the local Flower launcher), or with `state_dir`
    from a Flower node's own disk. An existing non-empty `out_dir` is left as it is unless
    `overwrite` (train never overwrites either). `say`: where a note goes (stderr)."""
    out = Path(out_dir).expanduser()
    if not overwrite and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not empty; choose another --out, or pass "
                        "--overwrite to replace an earlier export there")  # fmt: skip
    if base_model is not None and not peft:
        raise UserError("--base-model names a PEFT adapter's base model; add --peft")
    if state_dir is not None:
        params, config, model_dir = site_params(state_dir, client, run_id, round_)
    else:
        params, config, model_dir = personalised_params(run_dir, client, round_)
    if peft and config.lora is None:
        raise UserError(
            "--peft writes LoRA adapters and this run has none; export without --peft, or "
            "train with --lora-rank R"
        )
    base = Path(model_dir) if model_dir is not None and Path(model_dir).is_dir() else None
    if base is None:
        say(f"note: the base model's directory {model_dir} is not on this machine, so no "
            "tokenizer files are written; copy them from the base model")  # fmt: skip
    if not peft:
        if config.lora is not None:
            params, config = lora.merge(params, config)
        return hf_checkpoint.save_pretrained(params, config, out, tokenizer_dir=base)
    if base_model is None:
        base_model = peft_base(run_dir, model_dir, say)
    return peft_export.save_peft(
        params, config, out, base_model=base_model, tokenizer_dir=base,
        base_has_pooler=base is None or hf_checkpoint.has_pooler(base),
    )  # fmt: skip


def peft_base(
    run_dir: str | Path | None, model_dir: str | None, say: Callable[[str], None]
) -> str | None:
    """A PEFT adapter's `base_model_name_or_path`: the hub id of the model the run started from
    (`hf_hub.hub_id` of config.json's `model` and the directory it was loaded from), else
    that directory, with a note saying how to name it."""
    model = None
    if run_dir is not None:
        try:
            model = outputs.read_json(Path(run_dir) / "config.json").get("model")
        except (OSError, ValueError, AttributeError):
            model = None  # a run without its config: the directory alone tells
    found = hf_hub.hub_id(model if isinstance(model, str) else None, model_dir)
    if found is None:
        say(f"note: the adapter names its base model by the local path {model_dir}; pass "
            "--base-model ID (its hub id) so that it loads on another machine")  # fmt: skip
    return found or model_dir


def skew_note(run_dir: str | Path, client: int) -> str | None:
    """What a person must know before using a client's model: it carries its client's label skew.
    Its score on its own test split beside the mean over clients and beside what the client's
    majority label alone scores; None where the run holds no such figures (e.g. token tasks)."""
    run_dir = Path(run_dir)
    try:
        # a DP run's per-client figures are in the server's private folder (run.safeguards)
        def own(name: str, public: str) -> Path:
            private = run_dir / outputs.PRIVATE_DIR / name
            return private if private.is_file() else run_dir / public

        part = outputs.read_json(own("partition.json", "partition.json"))
        records = outputs.read_jsonl(own(outputs.PRIVATE_RECORDS, "metrics.jsonl"))
        shares = part["realised_shares"][client]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    names = part.get("label_names") or [str(i) for i in range(len(shares))]
    evaluated = [r for r in records if r.get("clients")]
    if not evaluated or len(names) != len(shares):
        return None
    last = evaluated[-1]
    own = {c.get("client"): c for c in last["clients"]}.get(client, {})
    metric = next((k for k in ("accuracy", "f1", "matthews") if k in own), None)
    if metric is None or last.get(metric) is None:
        return None
    top = sorted(range(len(shares)), key=lambda i: -shares[i])[:3]
    mix = " / ".join(f"{100 * shares[i]:.0f}% {names[i]}" for i in top)
    skewed = max(shares) > 1 / len(shares) + 0.1
    lean = ", and its model leans the same way" if skewed else ""
    return (
        f"client {client}'s data are {mix}{lean}: {metric} {own[metric]:.4f} on its own test "
        f"split after round {last['round']} (its majority label alone: about {max(shares):.2f}; "
        f"mean over clients {last[metric]:.4f}). Judge it on data like client {client}'s."
    )
