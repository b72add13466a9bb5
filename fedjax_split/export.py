"""Export one client's personalised model as a Hugging Face directory.

  python -m fedjax_split.export --run-dir runs/X --client 0 --out exported/client0

The personalised model is the global part (as the client received it, cast to fp32) merged with
that client's local part: the global part from the run's latest checkpoint (or --round), the
local part as it was after that round, from the run's client store. The result loads in
transformers as `BertForSequenceClassification` (`BertForTokenClassification` for a token task) and
in fedjax_split via `load_pretrained`. A LoRA run's adapters are merged into their layers; with
--peft they are written instead as a PEFT adapter directory for the base model (docs/lora.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedjax_split.errors import UserError, report


def personalised_params(run_dir: str | Path, client: int, round_: int | None = None) -> Any:
    """(params, BertConfig, model_dir) of client `client` from the run's checkpoint."""
    import jax.numpy as jnp

    from fedjax_split.fed.roles import merge_params
    from fedjax_split.fed.wire import cast_from_wire
    from fedjax_split.models import lora
    from fedjax_split.models.bert import BertConfig
    from fedjax_split.run.checkpoint import RunCheckpointer, checkpoint_dir
    from fedjax_split.run.experiment import CLIENTS_DIR
    from fedjax_split.sim.client_store import ClientStore

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
    global_params = cast_from_wire(state["server_state"]["global_params"], jnp.float32)
    store = ClientStore(Path(run_dir) / CLIENTS_DIR)
    if not (store.directory / "initial.npz").is_file():
        raise UserError(f"{str(run_dir)!r} has no client store ({CLIENTS_DIR}/) to export from")
    local = store.load(client, at_most=int(meta["round"]))
    params = merge_params(global_params, local, state.get("frozen", {}))  # saved when there is one
    config = lora.from_fields(BertConfig.from_hf_dict(meta["model_config"]), meta.get("lora"))
    return params, config, meta["model_dir"]


def export_client(
    run_dir: str | Path,
    client: int,
    out_dir: str | Path,
    round_: int | None = None,
    *,
    peft: bool = False,
) -> Path:
    """Writes client `client`'s model to `out_dir`: a Hugging Face model directory (a LoRA run's
    adapters merged into their layers), or with `peft` the client's LoRA adapters and head as a
    PEFT adapter directory for the run's base model."""
    from fedjax_split.models import hf_checkpoint, lora

    params, config, model_dir = personalised_params(run_dir, client, round_)
    base = Path(model_dir) if model_dir is not None and Path(model_dir).is_dir() else None
    if peft:
        if not config.lora_targets:
            raise UserError(
                "--peft writes LoRA adapters and this run has none; export without --peft, or "
                "train with --lora-rank R"
            )
        return lora.save_peft(
            params, config, out_dir, base_model=model_dir,
            base_has_pooler=base is None or hf_checkpoint.has_pooler(base),
        )  # fmt: skip
    if config.lora_targets:
        params, config = lora.merge(params, config)
    return hf_checkpoint.save_pretrained(params, config, out_dir, tokenizer_dir=base)


def skew_note(run_dir: str | Path, client: int) -> str | None:
    """What a person must know before using a client's model: it carries its client's label skew.
    Its score on its own test split beside the mean over clients and beside what the client's
    majority label alone scores; None where the run holds no such figures (e.g. token tasks)."""
    from fedjax_split.run import outputs

    run_dir = Path(run_dir)
    try:
        part = outputs.read_json(run_dir / "partition.json")
        records = outputs.read_jsonl(run_dir / "metrics.jsonl")
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedjax_split.export", description=__doc__.split("\n")[0]
    )
    p.add_argument("--run-dir", required=True, help="Run directory written by fedjax_split.train.")
    p.add_argument("--client", required=True, type=int, help="Client id (0-based) to export.")
    p.add_argument("--out", required=True, help="Output directory (Hugging Face format).")
    p.add_argument("--round", type=int, default=None, help="Checkpoint round (default: latest).")
    p.add_argument(
        "--peft",
        action="store_true",
        help="A LoRA run: write the client's adapters and head as a PEFT adapter directory "
        "(adapter_config.json, adapter_model.safetensors) instead of the merged model.",
    )
    args = p.parse_args(argv)
    try:
        out = export_client(args.run_dir, args.client, args.out, args.round, peft=args.peft)
    except UserError as e:
        return report(e)
    what = "LoRA adapters and head (PEFT)" if args.peft else "personalised model"
    print(f"wrote client {args.client}'s {what} to {out}")
    note = skew_note(args.run_dir, args.client)
    if note is not None:
        print(note)
    return 0


def cli() -> None:
    """`python -m fedjax_split.export`: the commands' entry point (`cli.run_command`)."""
    from fedjax_split.cli import run_command

    run_command(main)


if __name__ == "__main__":
    cli()
