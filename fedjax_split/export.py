"""Export one client's personalised model as a Hugging Face directory.

  python -m fedjax_split.export --run-dir runs/X --client 0 --out exported/client0

The personalised model is the global part (as the client received it, cast to fp32) merged with
that client's local part: the global part from the run's latest checkpoint (or --round), the
local part as it was after that round, from the run's client store (a run of the local Flower
launcher: from the node that held the client). At a Flower site, `--state-dir` assembles it from
the node's own disk: the global part it last received and its local part, which never travel.
The result loads in transformers as `BertForSequenceClassification`
(`BertForTokenClassification` for a token task) and in fedjax_split via `load_pretrained`. A
LoRA run's adapters are merged into their layers; with --peft they are written instead as a PEFT
adapter directory for the base model, named by its hub id where the run started from one (or by
--base-model), with the base's tokenizer beside it (docs/lora.md). Like train, it never
overwrites: an existing non-empty --out stops it unless --overwrite.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fedjax_split.cli import run_command
from fedjax_split.errors import UserError, report
from fedjax_split.run.settings import Parser

if TYPE_CHECKING:  # for type checkers and readers; at run time `__getattr__` imports them
    from fedjax_split.exporting import (
        export_client,
        peft_base,
        personalised_params,
        site_params,
        skew_note,
    )

__all__ = ["cli", "export_client", "main", "peft_base", "personalised_params", "site_params",
           "skew_note"]  # fmt: skip
_LIBRARY = frozenset(__all__) - {"cli", "main"}


def __getattr__(name: str) -> Any:
    """The library's functions (`fedjax_split.exporting`), imported when first used: the command
    parses its flags without importing JAX."""
    if name not in _LIBRARY:
        raise AttributeError(f"module 'fedjax_split.export' has no attribute {name!r}")
    return getattr(importlib.import_module("fedjax_split.exporting"), name)


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="python -m fedjax_split.export", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", help="Run directory written by fedjax_split.train or .flower.")
    where.add_argument(
        "--state-dir",
        help="At a Flower site: the SuperNode's state-dir; the model is assembled from the global "
        "part the node last received and its own local part, without leaving the site.",
    )
    p.add_argument("--run-id", default=None, help="With --state-dir: the run (default: the one).")
    p.add_argument("--client", required=True, type=int, help="Client id (0-based) to export.")
    p.add_argument("--out", required=True, help="Output directory (Hugging Face format); an "
                   "existing non-empty one is left as it is unless --overwrite.")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="Replace an earlier export in --out.")  # fmt: skip
    p.add_argument("--round", type=int, default=None, help="Checkpoint round (default: latest).")
    p.add_argument(
        "--peft",
        action="store_true",
        help="A LoRA run: write the client's adapters and head as a PEFT adapter directory "
        "(adapter_config.json, adapter_model.safetensors, the base's tokenizer files) instead "
        "of the merged model.",
    )
    p.add_argument(
        "--base-model", metavar="ID", default=None,
        help="With --peft: the base model's name in the adapter (base_model_name_or_path), e.g. "
        "its hub id. Default: the hub id of the model the run started from (a hub id, or "
        "minilm-l6: sentence-transformers/all-MiniLM-L6-v2), else its local path.",
    )  # fmt: skip
    args = p.parse_args(argv)
    from fedjax_split import exporting  # the job (JAX, the model): once the flags are parsed

    try:
        out = exporting.export_client(
            args.run_dir, args.client, args.out, args.round, peft=args.peft,
            state_dir=args.state_dir, run_id=args.run_id, base_model=args.base_model,
            overwrite=args.overwrite,
        )  # fmt: skip
    except UserError as e:
        return report(e)
    what = "personalised model"
    if args.peft:
        base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
        what = f"LoRA adapters and head (PEFT, for base model {base})"
    print(f"wrote client {args.client}'s {what} to {out}")
    note = None if args.run_dir is None else exporting.skew_note(args.run_dir, args.client)
    if note is not None:
        print(note)
    return 0


def cli() -> None:
    """`python -m fedjax_split.export`: the commands' entry point (`cli.run_command`)."""
    run_command(main)


if __name__ == "__main__":
    cli()
