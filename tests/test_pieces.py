"""run.pieces: the config -> pieces API every execution path builds from (the subsample, scoring
over clients, the round's bytes and seconds, the clients trained so far)."""

from __future__ import annotations

import numpy as np
import pytest

from fedjax_split.errors import UserError
from fedjax_split.fed.strategy import train_record
from fedjax_split.run import client_data, client_scores, pieces, round_records


def test_subsample_indices_are_seeded_sorted_and_distinct() -> None:
    a = client_data.subsample_indices(100, 10, seed=3)
    assert a is not None and a.size == 10 and np.all(np.diff(a) > 0) and a.max() < 100
    np.testing.assert_array_equal(a, client_data.subsample_indices(100, 10, seed=3))
    assert not np.array_equal(a, client_data.subsample_indices(100, 10, seed=4))
    assert client_data.subsample_indices(100, None, seed=0) is None
    assert client_data.subsample_indices(100, 100, seed=0) is None


def test_subsample_keeps_every_per_example_field_aligned() -> None:
    from fedjax_split.data.examples import Examples

    n = 10
    ex = Examples(
        texts_a=[f"a{i}" for i in range(n)],
        texts_b=[f"b{i}" for i in range(n)],
        labels=np.arange(n) % 3,
        groups=np.array([f"g{i}" for i in range(n)]),
        splits=np.array([f"s{i}" for i in range(n)]),
    )
    sub = client_data.subset_examples(ex, np.array([1, 4, 7]))
    assert sub.texts_a == ["a1", "a4", "a7"] and sub.texts_b == ["b1", "b4", "b7"]
    assert sub.labels.tolist() == [1, 1, 1] and sub.groups.tolist() == ["g1", "g4", "g7"]
    assert sub.splits.tolist() == ["s1", "s4", "s7"] and len(sub) == 3


def test_mean_over_clients_skips_undefined_metrics() -> None:
    per_client = [
        {"client": 0, "pearson": 0.5, "spearman": 0.25},
        {"client": 1, "pearson": float("nan"), "spearman": 0.75},  # constant test split
        {"client": 3, "pearson": 0.9, "spearman": None},
    ]
    assert client_scores.mean_over_clients(per_client) == {
        "pearson": pytest.approx(0.7),
        "spearman": pytest.approx(0.5),
    }
    nan = client_scores.mean_over_clients([{"client": 0, "pearson": float("nan")}])["pearson"]
    assert np.isnan(nan)
    assert client_scores.mean_over_clients([]) == {}


def test_round_chunk_size_defaults_by_backend() -> None:
    assert pieces.round_chunk_size(None, "cpu") == 1
    assert pieces.round_chunk_size(None, "gpu") is None
    assert pieces.round_chunk_size(None, "tpu") is None
    assert pieces.round_chunk_size(4, "cpu") == 4
    assert pieces.round_chunk_size(4, "gpu") == 4
    # several processes: one at a time wherever they run, and no chunk spanning them
    assert pieces.round_chunk_size(None, "gpu", 2) == 1
    assert pieces.round_chunk_size(1, "gpu", 2) == 1
    with pytest.raises(UserError, match="with 2 processes"):
        pieces.round_chunk_size(4, "cpu", 2)


def test_personalised_record_means_over_all_and_over_the_trained() -> None:
    per_client = [{"client": 0, "accuracy": 0.5}, {"client": 2, "accuracy": 1.0}]
    record = client_scores.personalised_record(per_client, trained={2, 7})
    # two clients: the 10th percentile is a tenth of the way from the lower to the higher
    assert record == {"accuracy": 0.75, "clients": per_client, "trained_mean": {"accuracy": 1.0},
                      "worst_client": {"accuracy": 0.5},
                      "p10_client": {"accuracy": pytest.approx(0.55)}}  # fmt: skip
    assert "trained_mean" not in client_scores.personalised_record(per_client, None)
    assert "global_clients" not in record and "personalization_gain" not in record
    # no client with test examples: no spread to give
    assert client_scores.personalised_record([], None) == {"clients": []}


def test_the_worst_client_and_the_10th_percentile_by_hand() -> None:
    """Per metric, over the clients that have a defined figure: the minimum, and the 10th
    percentile by linear interpolation (position 0.1 (n - 1) among the sorted figures)."""
    nan = float("nan")
    per_client = [
        {"client": 0, "accuracy": 0.9, "f1": 0.3},
        {"client": 1, "accuracy": 0.2, "f1": nan},  # f1 undefined here: left out of f1's
        {"client": 2, "accuracy": 0.6, "f1": 0.7},
        {"client": 4, "accuracy": 0.4},
        {"client": 5, "accuracy": 0.8, "f1": 0.5},
    ]
    spread = client_scores.spread_over_clients(per_client)
    # accuracy sorted 0.2, 0.4, 0.6, 0.8, 0.9: position 0.4, between 0.2 and 0.4
    assert spread["worst_client"]["accuracy"] == 0.2
    assert spread["p10_client"]["accuracy"] == pytest.approx(0.2 + 0.4 * (0.4 - 0.2))
    # f1 sorted 0.3, 0.5, 0.7: position 0.2, between 0.3 and 0.5
    assert spread["worst_client"]["f1"] == 0.3
    assert spread["p10_client"]["f1"] == pytest.approx(0.3 + 0.2 * (0.5 - 0.3))
    one = client_scores.spread_over_clients([{"client": 3, "accuracy": 0.7}])
    assert one == {"worst_client": {"accuracy": 0.7}, "p10_client": {"accuracy": 0.7}}
    undefined = client_scores.spread_over_clients([{"client": 0, "pearson": nan}])
    assert np.isnan(undefined["worst_client"]["pearson"])


def test_the_personalisation_gain_is_the_mean_of_each_clients_own_difference() -> None:
    """Personal minus global on each client's own split, mean over the clients where both are
    defined: client 2's f1 is undefined for its personal model, client 3 has no global figure
    (it did not answer), client 1's global f1 is undefined."""
    nan = float("nan")
    row = lambda c, a, f: {"client": c, "accuracy": a, "f1": f}  # noqa: E731
    personal = [row(0, 0.8, 0.9), row(1, 0.6, 0.4), row(2, 0.7, nan), row(3, 1.0, 1.0)]
    theirs = [row(0, 0.5, 0.2), row(1, 0.7, nan), row(2, 0.4, 0.1)]
    gain = client_scores.personalization_gain(personal, theirs)
    assert gain["accuracy"] == pytest.approx(((0.8 - 0.5) + (0.6 - 0.7) + (0.7 - 0.4)) / 3)
    assert gain["f1"] == pytest.approx(0.9 - 0.2)
    record = client_scores.personalised_record(personal, None, theirs)
    assert record["global_clients"] == theirs and record["personalization_gain"] == gain


def test_newest_rounds_are_each_clients_last_sampled_round() -> None:
    history = [{"round": 1, "clients_sampled": [0, 1]}, {"round": 2, "clients_sampled": []},
               {"round": 3, "clients_sampled": [1, 2]}]  # fmt: skip
    assert round_records.newest_rounds(history) == {0: 1, 1: 3, 2: 3}
    assert round_records.newest_rounds([]) == {}


def test_trained_clients_leave_out_failed_clients_and_add_the_current_round() -> None:
    history = [
        {"clients_sampled": [0, 1]},
        {"clients_sampled": [1, 2], "clients_failed": [2]},  # a deployed round: 2 failed
    ]
    assert round_records.trained_clients(history) == {0, 1}
    assert round_records.trained_clients(history, [np.int32(4)]) == {0, 1, 4}
    assert round_records.trained_clients([]) == set()


def test_round_costs_accumulate_bytes_and_split_seconds() -> None:
    first = round_records.round_costs([], 10, 30, t0=1.0, t_train=3.0, t_eval=3.5)
    assert first["cum_bytes"] == 40 and first["seconds"] == 2.5
    assert first["train_seconds"] == 2.0 and first["eval_seconds"] == 0.5
    second = round_records.round_costs([first], 1, 2, t0=0.0, t_train=1.0, t_eval=1.0)
    assert (second["cum_bytes_up"], second["cum_bytes_down"], second["cum_bytes"]) == (11, 32, 43)
    assert second["bytes_up"] == 1 and second["eval_seconds"] == 0.0


def test_train_record_is_the_example_weighted_mean_of_the_clients_losses() -> None:
    record = train_record(3, [np.int32(4), 1], np.array([1.0, 4.0]), np.array([3.0, 1.0]))
    assert record == {"round": 3, "clients_sampled": [4, 1], "train_loss": 1.75,
                      "train_loss_clients": [1.0, 4.0]}  # fmt: skip
    assert all(type(c) is int for c in record["clients_sampled"])  # JSON-ready


def _site(path, rows, dev=()):
    path.mkdir(parents=True)
    for name, lines in (("train.tsv", rows), ("dev.tsv", dev)):
        if lines:
            text = "".join(f"{s}\t{y}\n" for s, y in lines)
            (path / name).write_text("sentence\tlabel\n" + text)
    return path


def test_load_sites_gives_client_k_exactly_site_ks_rows(tmp_path) -> None:
    from fedjax_split.run.config import resolve_config
    from fedjax_split.tasks.registry import get_task

    a = _site(tmp_path / "a", [("a0", 1), ("a1", 1), ("a2", 0)], dev=[("ad", 1)])
    b = _site(tmp_path / "b", [(f"b{i}", i % 2) for i in range(10)])  # no dev: 80/20
    config = resolve_config(overrides={"site_data": f"{a},{b}", "seed": 3})
    examples, part = client_data.load_sites(config, get_task("sst2"))
    assert part.scheme == "sites" and part.num_examples == len(examples) == 14
    texts = np.asarray(examples.texts_a)
    assert texts[part.clients[0].train].tolist() == ["a0", "a1", "a2"]
    assert texts[part.clients[0].test].tolist() == ["ad"]
    b_rows = sorted(texts[np.concatenate([part.clients[1].train, part.clients[1].test])])
    assert b_rows == sorted(f"b{i}" for i in range(10)) and part.clients[1].test.size == 2
    assert examples.labels[part.clients[1].train].tolist() == [
        int(t[1:]) % 2 for t in texts[part.clients[1].train]]  # fmt: skip


def test_a_bad_site_is_one_line_naming_the_site_and_its_file(tmp_path) -> None:
    from fedjax_split.run.config import resolve_config
    from fedjax_split.run.sites import NODE_SITES
    from fedjax_split.tasks.registry import get_task

    a = _site(tmp_path / "a", [("a0", 1)])
    b = _site(tmp_path / "b", [("b0", 1), ("b1", "maybe")])
    config = resolve_config(overrides={"site_data": f"{a},{b}"})
    with pytest.raises(UserError) as err:
        client_data.load_sites(config, get_task("sst2"))
    assert str(err.value).startswith(f"site 1 ({b}): task sst2: 1 invalid rows, e.g. ")
    assert "train.tsv:3 (label 'maybe')" in str(err.value)
    # a train file without examples, beside a dev file: nothing to train on
    c = _site(tmp_path / "c", [("c0", 0)], dev=[("cd", 1)])
    (c / "train.tsv").write_text("sentence\tlabel\n")
    config = resolve_config(overrides={"site_data": f"{a},{c}"})
    with pytest.raises(UserError, match=r"site 1 \(.*c\) has no training examples"):
        client_data.load_sites(config, get_task("sst2"))
    real = resolve_config(overrides={"site_data": NODE_SITES})
    with pytest.raises(UserError, match="the simulation reads every site itself"):
        client_data.load_sites(real, get_task("sst2"))


def test_a_token_tasks_vocabulary_comes_from_the_task_or_the_config_never_the_sites() -> None:
    from fedjax_split.run.config import resolve_config
    from fedjax_split.run.sites import NODE_SITES
    from fedjax_split.tasks.registry import get_task

    def types(task: str, **values: object) -> object:
        return client_data.entity_types(resolve_config(overrides=values), get_task(task))

    assert types("ner") is None  # a pool's own tags
    assert types("ner", entity_types="PER,LOC") == ("LOC", "PER")
    assert client_data.tag_names(resolve_config(overrides={"entity_types": "PER"}),
                            get_task("ner")) == ("O", "B-PER", "I-PER")  # fmt: skip
    wnut16 = get_task("wnut16").entity_types
    assert types("wnut16") == types("wnut16", site_data=NODE_SITES) == wnut16
    assert types("sst2") is None and client_data.tag_names(resolve_config(), get_task("sst2")) == ()
    with pytest.raises(UserError, match="^task ner with --site-data needs .*pass --entity-types"):
        types("ner", site_data=NODE_SITES)
    with pytest.raises(UserError, match="task wnut16 has its own types company,facility"):
        types("wnut16", entity_types="PER")
    with pytest.raises(UserError, match="--entity-types PER with task sst2: only a token task"):
        types("sst2", entity_types="PER")


def test_load_sites_of_a_token_task_in_the_configs_vocabulary(tmp_path) -> None:
    from run_fixtures import write_tiny_conll

    from fedjax_split.run.config import resolve_config
    from fedjax_split.tasks.registry import get_task

    a = write_tiny_conll(tmp_path / "a", n_train=5, n_test=2, seed=1)
    b = write_tiny_conll(tmp_path / "b", n_train=4, n_test=0, seed=2)
    config = resolve_config(overrides={"site_data": f"{a},{b}", "entity_types": "pos,neg,misc"})
    examples, part = client_data.load_sites(config, get_task("ner"))
    assert examples.tag_names == ("O", "B-misc", "I-misc", "B-neg", "I-neg", "B-pos", "I-pos")
    assert [(len(c.train), len(c.test)) for c in part.clients] == [(5, 2), (3, 1)]
    (b / "train.txt").write_text("w O\n\nv B-loc\n")
    with pytest.raises(UserError) as err:
        client_data.load_sites(config, get_task("ner"))
    assert str(err.value).startswith(f"site 1 ({b}): {b / 'train.txt'}:3: tag 'B-loc' is not")


def test_concat_examples_joins_every_per_row_field_in_order() -> None:
    from fedjax_split.data.examples import Examples

    one = Examples(["x", "y"], ["p", "q"], np.array([0, 2]), np.array(["m", "m"]),
                   np.array(["train", "validation"]))  # fmt: skip
    two = Examples(["z"], ["r"], np.array([1]), np.array(["mm"]), np.array(["train"]))
    both = client_data.concat_examples([one, two])
    assert both.texts_a == ["x", "y", "z"] and both.texts_b == ["p", "q", "r"]
    assert both.labels.tolist() == [0, 2, 1] and both.groups.tolist() == ["m", "m", "mm"]
    assert both.splits.tolist() == ["train", "validation", "train"]


def test_sites_rows_are_as_wide_as_max_length_allows_whatever_their_data() -> None:
    """A site sees no pool: its rows (packed W, padded T) come from --max-length, and its packed
    parts' tokens from the batch size and W alone, so all sites agree. A pool's rows come from
    its longest example (at least 64 packed, 8 padded) and its parts' N from the pool itself."""
    from fedjax_split.data.tokenization import Tokenized
    from fedjax_split.run.config import ExperimentConfig
    from fedjax_split.run.settings import replaced
    from fedjax_split.tasks.registry import get_task

    short = Tokenized([np.ones(3, np.int32)], [np.zeros(3, np.int32)], np.array([3]))
    long = Tokenized([np.ones(13, np.int32)], [np.zeros(13, np.int32)], np.array([13]))
    sites = ExperimentConfig.of(packing=True, site_data="a,b", max_length=100, batch_size=16,
                                bucketing=False)  # fmt: skip
    assert client_data.row_width(sites, short) == 104  # 100 rounded up to a multiple of 8
    assert client_data.row_width(replaced(sites, max_length=16), short) == 64
    pool = replaced(sites, site_data=None)
    assert client_data.row_width(pool, short) == 64  # the pool's longest example, at least 64
    padded_sites = replaced(sites, packing=False)
    assert client_data.row_width(padded_sites, short) == 104  # padded T: the same bound
    padded_pool = replaced(pool, packing=False)
    assert client_data.row_width(padded_pool, short) == 8
    assert client_data.row_width(padded_pool, long) == 16
    # N of a site's parts: B half-full rows of W (whole rows), from the config alone
    task = get_task("sst2")
    how = client_data.batching_of(sites, task, 104)
    assert (how.batch_size, how.row_width, how.part_tokens) == (16, 104, 8 * 104)
    evaluation = client_data.batching_of(sites, task, 104, evaluation=True)
    assert evaluation.part_tokens == 16 * 104  # B 32
    # from the pool when batching
    assert client_data.batching_of(pool, task, 64).part_tokens is None
    assert client_data.batching_of(padded_sites, task, 104).part_tokens is None
