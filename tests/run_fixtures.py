"""Tiny end-to-end fixtures: a random-init HF-format BERT directory and GLUE-format SST-2 files.

Used by the CLI/experiment/notebook tests so that a whole federated run takes seconds on a CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

POSITIVE = ["good", "great", "fine", "superb", "lovely", "fun"]
NEGATIVE = ["bad", "awful", "poor", "dull", "boring", "weak"]
FILLER = ["the", "movie", "film", "was", "a", "plot", "story", "very", "quite", "and"]


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory):
    """Tokenised-data cache files of these runs go to a temp dir, not the user's cache.

    Autouse in every module that imports it (module scope: one cache per test module).
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDJAX_SPLIT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def cli_env(jax_cache: Path | None = None) -> dict[str, str]:
    """The environment of a CLI subprocess under test: CPU, this checkout first on the path, and
    none of the knobs a developer's shell may carry (a stop-after-round, a preloaded malloc, the
    allocator mode), so that every run starts as a user's would. `jax_cache`: a persistent XLA
    cache of the module's own, caching every program (default: the session's, tests/conftest.py).
    """
    from fedjax_split import runtime

    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    if jax_cache is not None:
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(jax_cache),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    for name in ("FEDJAX_SPLIT_STOP_AFTER_ROUND", "LD_PRELOAD", runtime.MALLOC_ENV):
        env.pop(name, None)  # every CLI run starts on the system's malloc, then tunes it
    return env


def write_tiny_model(
    out_dir: Path, *, num_layers: int = 2, seed: int = 0, hidden_size: int = 32
) -> Path:
    """A 2-layer hidden-32 BERT (intermediate size twice the hidden) with random weights and a
    word-level vocab, saved in HF format."""
    import jax

    from fedjax_split.models.bert import BertConfig, init_params
    from fedjax_split.models.hf_checkpoint import save_pretrained

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *POSITIVE, *NEGATIVE, *FILLER]
    tok_dir = out_dir.parent / (out_dir.name + "_tok")
    tok_dir.mkdir(parents=True, exist_ok=True)
    (tok_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=64,
        num_labels=2,
    )
    params = init_params(config, jax.random.key(seed))
    return save_pretrained(params, config, out_dir, tokenizer_dir=tok_dir)


def write_tiny_sst2(
    data_dir: Path, *, n_train: int = 96, n_dev: int = 24, seed: int = 0,
    positive: float | None = None,
) -> Path:  # fmt: skip
    """GLUE-format SST-2 (train.tsv / dev.tsv, columns sentence and label), learnable by word;
    `positive`: the chance of label 1 (None: even); `n_dev` 0: no dev.tsv."""
    rng = np.random.default_rng(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.tsv", n_train), ("dev.tsv", n_dev)):
        if name == "dev.tsv" and n == 0:
            continue
        lines = ["sentence\tlabel"]
        for _ in range(n):
            label = int(rng.integers(2)) if positive is None else int(rng.random() < positive)
            words = list(rng.choice(FILLER, size=int(rng.integers(2, 7))))
            cue = POSITIVE if label else NEGATIVE
            words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(cue)))
            lines.append(f"{' '.join(words)}\t{label}")
        (data_dir / name).write_text("\n".join(lines) + "\n")
    return data_dir


# three sites of their own: different sizes and label skews, one without a dev file (80/20)
SITES = ({"n_train": 40, "n_dev": 12, "positive": 0.85},
         {"n_train": 22, "n_dev": 0, "positive": 0.5},
         {"n_train": 64, "n_dev": 20, "positive": 0.15})  # fmt: skip


def write_tiny_sites(base: Path) -> list[Path]:
    """SITES as GLUE-format SST-2 directories base/site_<k> (each its own seed)."""
    return [write_tiny_sst2(base / f"site_{k}", seed=10 + k, **site)
            for k, site in enumerate(SITES)]  # fmt: skip


def tsv_rows(path: Path) -> int:
    """The examples of a GLUE TSV file with a header (its lines less the header)."""
    return len(path.read_text().splitlines()) - 1


def tiny_sst2_files(base: Path) -> dict[str, Path]:
    """A test module's run files under `base`: the tiny model and tiny SST-2."""
    return {"base": base, "model": write_tiny_model(base / "model"),
            "data": write_tiny_sst2(base / "data")}  # fmt: skip


def write_tiny_conll(
    data_dir: Path, *, n_train: int = 120, n_test: int = 30, seed: int = 0
) -> Path:
    """CoNLL NER files (train.txt / test.txt) over the tiny model's words, learnable by word:
    positive words are `pos` entities (a run of two is one entity), negative words `neg`."""
    from fedjax_split.data.tokens.conll import write_conll

    rng = np.random.default_rng(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.txt", n_train), ("test.txt", n_test)):
        if n == 0:  # no such file (a site without one tests on a fifth of its train file)
            continue
        sentences = []
        for _ in range(n):
            words = list(rng.choice(FILLER, size=int(rng.integers(2, 6))))
            tags = ["O"] * len(words)
            for kind, pool in (("pos", POSITIVE), ("neg", NEGATIVE)):
                if rng.random() < 0.7:
                    at = int(rng.integers(len(words) + 1))
                    span = list(rng.choice(pool, size=int(rng.integers(1, 3))))
                    words[at:at] = span
                    tags[at:at] = [f"B-{kind}"] + [f"I-{kind}"] * (len(span) - 1)
            sentences.append((words, tags))
        write_conll(data_dir / name, sentences)
    return data_dir


# three NER sites of their own: different sizes, one without a test file (80/20)
NER_SITES = ({"n_train": 30, "n_test": 10}, {"n_train": 14, "n_test": 0},
             {"n_train": 45, "n_test": 12})  # fmt: skip
NER_TYPES = "neg,pos"  # write_tiny_conll's entity types: the sites' --entity-types


def write_tiny_ner_sites(base: Path) -> list[Path]:
    """NER_SITES as CoNLL directories base/ner_site_<k> (each its own seed)."""
    return [write_tiny_conll(base / f"ner_site_{k}", seed=20 + k, **site)
            for k, site in enumerate(NER_SITES)]  # fmt: skip


def conll_sentences(path: Path) -> int:
    """The sentences of a CoNLL file as write_conll writes it (a blank line after each)."""
    return path.read_text().count("\n\n")


def write_tiny_text(data_dir: Path, *, seed: int = 0) -> Path:
    """Two .txt files (two sources) of 30 blank-line-separated documents of the tiny model's
    words each, for further pre-training."""
    rng = np.random.default_rng(seed)
    words = FILLER + POSITIVE + NEGATIVE
    data_dir.mkdir(parents=True, exist_ok=True)
    for name in ("old.txt", "new.txt"):
        docs = [
            "\n".join(" ".join(rng.choice(words, size=int(rng.integers(4, 12))))
                      for _ in range(int(rng.integers(1, 4))))
            for _ in range(30)
        ]  # fmt: skip
        (data_dir / name).write_text("\n\n".join(docs) + "\n")
    return data_dir


def write_text_sites(base: Path) -> list[Path]:
    """Two sites of further pre-training text, base/site_<k>, each its own seed: site 0 two
    .txt files (60 documents), site 1 one (30), so that the sites differ in size and text."""
    dirs = [write_tiny_text(base / f"site_{k}", seed=20 + k) for k in range(2)]
    (dirs[1] / "new.txt").unlink()
    return dirs


# Parameter counts of write_tiny_model's BERT (hidden 32, intermediate 64, positions 64), which a
# further pre-training client sends: one encoder layer, the MLM head (transform, LayerNorm,
# output bias), the embeddings (word, position, token type, LayerNorm).
TINY_VOCAB = 5 + len(POSITIVE) + len(NEGATIVE) + len(FILLER)
TINY_LAYER = 4 * (32 * 32 + 32) + 2 * 32 + (32 * 64 + 64) + (64 * 32 + 32) + 2 * 32
TINY_MLM_HEAD = (32 * 32 + 32) + 2 * 32 + TINY_VOCAB
TINY_EMBEDDINGS = TINY_VOCAB * 32 + 64 * 32 + 2 * 32 + 2 * 32


def tiny_args(model: Path, data: Path, out: Path, **extra: object) -> list[str]:
    """CLI flags of a tiny, fast run (4 rounds, 3 clients, critical layer 1 of 2); a flag
    given None is left out, one given True is a switch."""
    flags = {
        "task": "sst2",
        "model": str(model),
        "data-dir": str(data),
        "output-dir": str(out),
        "rounds": 4,
        "clients": 3,
        "critical-layer": 1,
        "local-epochs": 1,
        "batch-size": 8,
        "lr": 1e-3,
        "max-length": 16,
        "seed": 0,
    }
    flags.update({k.replace("_", "-"): v for k, v in extra.items()})
    # None: the flag left out; True: a switch given alone (--dp-insecure-reproducible-noise)
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in flags.items() if v is not None]
