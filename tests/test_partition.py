"""partition: paper tables, reassignment, Dirichlet skews, coverage, determinism, files, report."""

import json

import numpy as np
import pytest

from fedjax_split.data.label_skew import fill_counts
from fedjax_split.data.paper_tables import paper_shares
from fedjax_split.data.partition import (
    load_partition,
    partition_clients,
    partition_report,
    save_partition,
)
from fedjax_split.errors import UserError

# The paper's tables, typed in again here (share of class 1 first, see paper_tables.py's note).
TABLE_I_FIRST = {"mrpc": [85, 75, 25], "cola": [90.5, 83, 40], "qqp": [70, 37, 13],
                 "sst2": [80, 50, 20], "rte": [80, 50, 20]}  # fmt: skip
TABLE_II_FIRST = {"qqp": [90, 80, 70, 60, 50, 40, 30, 20, 10, 2]}


def _counts(partition, labels, num_classes):
    return np.array([np.bincount(labels[c.all], minlength=num_classes) for c in partition.clients])


def _check_cover(partition, n):
    every = np.concatenate([np.concatenate([c.train, c.test]) for c in partition.clients])
    np.testing.assert_array_equal(np.sort(every), np.arange(n))  # disjoint and covering


def _pool(class_counts, seed=0):
    y = np.repeat(np.arange(len(class_counts)), class_counts)
    return np.random.default_rng(seed).permutation(y)


@pytest.mark.parametrize("task", sorted(TABLE_I_FIRST))
def test_table_i_shares_exact_when_pool_matches(task):
    per_client = 1000
    ones = [round(per_client * s / 100) for s in TABLE_I_FIRST[task]]
    y = _pool([3 * per_client - sum(ones), sum(ones)])
    p = partition_clients(y, scheme="paper", num_clients=3, seed=0, task=task)
    _check_cover(p, y.size)
    counts = _counts(p, y, 2)
    np.testing.assert_array_equal(counts[:, 1], ones)
    np.testing.assert_array_equal(counts.sum(1), [per_client] * 3)


def test_table_i_mnli_three_classes():
    rows = np.array([[86, 5, 9], [5, 90, 5], [5, 5, 90]]) * 10
    y = _pool(rows.sum(0))
    p = partition_clients(y, scheme="paper", num_clients=3, seed=1, task="mnli")
    np.testing.assert_array_equal(_counts(p, y, 3), rows)


def test_table_ii_qqp_and_mrpc_k10():
    ones = np.array(TABLE_II_FIRST["qqp"]) * 10
    y = _pool([10000 - ones.sum(), ones.sum()])
    p = partition_clients(y, scheme="paper", num_clients=10, seed=0, task="qqp")
    np.testing.assert_array_equal(_counts(p, y, 2)[:, 1], ones)
    # MRPC row 10 is printed 51/48: renormalised to 51/99 of the client's 1000 examples
    mrpc_first = [92, 86, 71, 66, 50, 44, 35, 28, 12]
    ones = np.array([v * 10 for v in mrpc_first] + [round(1000 * 51 / 99)])
    y = _pool([10000 - ones.sum(), ones.sum()])
    # (the rounded row sums leave exact shares one example short: the sequential fill takes
    # the pool as is)
    p = partition_clients(y, scheme="paper", num_clients=10, seed=0, task="mrpc",
                          fill="sequential")  # fmt: skip
    np.testing.assert_array_equal(_counts(p, y, 2)[:, 1], ones)


# GLUE's label counts, train + validation (the paper's pool), class ids in GLUE's order
# (MNLI: entailment, neutral, contradiction; matched and mismatched validation together).
GLUE_COUNTS = {
    "sst2": [30208, 38013], "mrpc": [1323, 2753], "cola": [2850, 6744], "qqp": [255013, 149263],
    "qnli": [55068, 55138], "rte": [1395, 1372], "wnli": [352, 354],
    "mnli": [137841, 137152, 137356],
}  # fmt: skip
TABLE_ROWS = [(t, 3) for t in sorted(GLUE_COUNTS)] + [(t, 10) for t in ("qqp", "sst2", "qnli",
                                                                       "mrpc")]  # fmt: skip


@pytest.mark.parametrize(("task", "k"), TABLE_ROWS)
def test_exact_shares_within_one_example_on_glue_label_counts(task, k):
    """Default fill: every Table I/II row holds for every client, within one example, at one
    common size; the surplus is left out, and counted."""
    y = _pool(GLUE_COUNTS[task], seed=1)
    p = partition_clients(y, scheme="paper", num_clients=k, seed=0, task=task)
    counts = _counts(p, y, len(GLUE_COUNTS[task]))
    size = counts.sum(axis=1)
    assert np.all(size == size[0]) and size[0] > 0  # one common client size n
    shares = paper_shares(k, len(GLUE_COUNTS[task]), task)
    shares = shares / shares.sum(axis=1, keepdims=True)
    assert np.abs(counts - shares * size[0]).max() <= 1.0, (counts, shares * size[0])
    assert p.dropped == y.size - counts.sum() and p.fill == "exact"
    np.testing.assert_allclose(p.target_shares, paper_shares(k, len(GLUE_COUNTS[task]), task))
    # n is (up to rounding) the largest feasible: the class with the least to spare for the
    # table, argmin N_c / sum_k s_kc, is used up but for a few examples of rounding
    pool = np.asarray(GLUE_COUNTS[task])
    binding = int(np.argmin(pool / shares.sum(axis=0)))
    assert pool[binding] - counts[:, binding].sum() <= k + np.ceil(shares[:, binding].sum())
    every = np.concatenate([c.all for c in p.clients])
    assert np.unique(every).size == every.size


def test_sequential_fill_only_when_asked_and_it_misses_the_table_on_skewed_pools():
    """The former fill (|D|/K each, clients in order) on GLUE's counts: SST-2 at K=10 leaves the
    last client all positive (table: 2%), MRPC at K=3 gives client 3 42.6% (table: 25%)."""
    y = _pool(GLUE_COUNTS["sst2"], seed=1)
    p = partition_clients(y, scheme="paper", num_clients=10, seed=0, task="sst2",
                          fill="sequential")  # fmt: skip
    _check_cover(p, y.size)
    assert p.dropped == 0 and p.fill == "sequential"
    last = _counts(p, y, 2)[-1]
    assert last[1] / last.sum() > 0.99
    y = _pool(GLUE_COUNTS["mrpc"], seed=1)
    p = partition_clients(y, scheme="paper", num_clients=3, seed=0, task="mrpc",
                          fill="sequential")  # fmt: skip
    third = _counts(p, y, 2)[2]
    assert third[1] / third.sum() == pytest.approx(0.426, abs=0.001)
    with pytest.raises(UserError, match="unknown paper fill"):
        partition_clients(y, scheme="paper", num_clients=3, seed=0, fill="greedy")


def test_table_shares_within_tolerance_on_a_skewed_real_like_pool():
    # SST-2-like balance (55.8% positive), sequential fill: the first clients get their row, the
    # last absorbs the shortfall
    y = _pool([4420, 5580])
    p = partition_clients(y, scheme="paper", num_clients=3, seed=3, task="sst2",
                          fill="sequential")  # fmt: skip
    share = _counts(p, y, 2)[:, 1] / np.array([c.all.size for c in p.clients])
    assert abs(share[0] - 0.8) < 0.01 and abs(share[1] - 0.5) < 0.01
    assert share[2] > 0.2  # class 0 ran out: the vacancy was filled with class 1
    _check_cover(p, y.size)


def test_dynamic_reassignment_by_hand():
    # K=3 'other' row 80/50/20 (class 1 share); pool: 100 of class 1, 200 of class 0.
    y = _pool([200, 100])
    p = partition_clients(y, scheme="paper", num_clients=3, seed=0, task="rte", fill="sequential")
    # client 0: 80 ones + 20 zeros; client 1 wants 50 ones, 20 remain -> 20 ones + 80 zeros;
    # client 2: no ones left -> 100 zeros.
    np.testing.assert_array_equal(_counts(p, y, 2), [[20, 80], [80, 20], [100, 0]])


def test_fill_counts_spreads_the_shortfall_in_proportion_to_what_remains():
    np.testing.assert_array_equal(fill_counts(np.array([10, 10, 10]), np.array([4, 30, 10])),
                                  [4, 16, 10])  # fmt: skip
    # shortfall 6 over spare (20, 10) -> 4 and 2
    np.testing.assert_array_equal(fill_counts(np.array([10, 10, 10]), np.array([4, 30, 20])),
                                  [4, 14, 12])  # fmt: skip


def test_linear_ramp_for_other_k_and_multiclass():
    y = _pool([5000, 5000])
    p = partition_clients(y, scheme="paper", num_clients=5, seed=0)
    # ramp 80% .. 20% of class 1 over 5 clients: 80, 65, 50, 35, 20 percent of 2000
    np.testing.assert_array_equal(_counts(p, y, 2)[:, 1], [1600, 1300, 1000, 700, 400])
    y4 = _pool([3000] * 4)
    p4 = partition_clients(y4, scheme="paper", num_clients=3, seed=0)
    c = _counts(p4, y4, 4)
    # client 0: shares (1 + 0.6 (2v - 1)) / 4 with v = 0, 1/3, 2/3, 1 -> 0.1, 0.2, 0.3, 0.4
    np.testing.assert_array_equal(c[0], [400, 800, 1200, 1600])
    np.testing.assert_array_equal(c[1], [1000] * 4)
    _check_cover(p4, y4.size)


def test_stsb_sorted_contiguous_parts():
    scores = np.random.default_rng(0).uniform(0, 5, 301).astype(np.float32)
    p = partition_clients(scores, scheme="paper", num_clients=3, seed=0, task="stsb")
    _check_cover(p, scores.size)
    parts = [scores[c.all] for c in p.clients]
    assert [x.size for x in parts] == [101, 100, 100]
    assert parts[0].max() <= parts[1].min() and parts[1].max() <= parts[2].min()
    assert "min" in partition_report(p, scores)


@pytest.mark.parametrize(
    "kw",
    [dict(scheme="iid"), dict(scheme="dirichlet", alpha=0.5), dict(scheme="quantity", beta=1.0),
     dict(scheme="dirichlet", alpha=0.5, beta=2.0), dict(scheme="paper", fill="sequential")],
)  # fmt: skip
def test_every_scheme_covers_the_pool_once_and_splits_80_20(kw):
    y = _pool([700, 200, 100], seed=4)
    p = partition_clients(y, num_clients=6, seed=7, **kw)
    _check_cover(p, y.size)
    for c in p.clients:
        n = c.train.size + c.test.size
        assert c.test.size == int(np.floor(0.2 * n + 0.5))
        assert np.all(np.diff(c.train) > 0) and c.train.dtype == np.int64


def test_equal_sizes_without_quantity_skew():
    y = _pool([500, 503])
    for kw in (dict(scheme="iid"), dict(scheme="dirichlet", alpha=0.3)):
        p = partition_clients(y, num_clients=4, seed=0, **kw)
        assert sorted(c.all.size for c in p.clients) == [250, 251, 251, 251]


def test_alpha_large_is_near_iid_and_small_is_near_one_class():
    y = _pool([2000] * 4)
    p = partition_clients(y, scheme="dirichlet", alpha=1000.0, num_clients=8, seed=0)
    shares = _counts(p, y, 4) / 1000
    assert np.abs(shares - 0.25).max() < 0.07
    p = partition_clients(y, scheme="dirichlet", alpha=1e-3, num_clients=8, seed=2)
    top = (_counts(p, y, 4) / 1000).max(1)
    assert np.median(top) == 1.0 and top.mean() > 0.7  # collisions are filled by reassignment


def test_quantity_skew_sizes_follow_beta():
    y = np.zeros(200_000, np.int64)  # large enough that no client rounds to zero examples
    k = 10
    for beta in (1.0, 20.0):
        z = np.array([partition_clients(y, scheme="quantity", beta=beta, num_clients=k, seed=s,
                                        test_fraction=0.0).train_sizes / y.size
                      for s in range(60)])  # fmt: skip
        # z ~ Dir(beta 1_K): Var z_i = (1/K)(1 - 1/K) / (K beta + 1)
        expected = (1 / k) * (1 - 1 / k) / (k * beta + 1)
        assert z.var(axis=None) == pytest.approx(expected, rel=0.25)
        assert np.allclose(z.sum(1), 1.0)


def test_seed_determinism_and_global_state_untouched():
    y = _pool([300, 300, 400], seed=5)
    before = np.random.get_state()  # noqa: NPY002 - checking it is untouched
    kws = [dict(scheme="iid"), dict(scheme="dirichlet", alpha=0.5, beta=1.0), dict(scheme="paper")]
    for kw in kws:
        a = partition_clients(y, num_clients=4, seed=11, **kw)
        b = partition_clients(y, num_clients=4, seed=11, **kw)
        c = partition_clients(y, num_clients=4, seed=12, **kw)
        for x, z in zip(a.clients, b.clients, strict=True):
            np.testing.assert_array_equal(x.train, z.train)
            np.testing.assert_array_equal(x.test, z.test)
        assert any(not np.array_equal(x.train, z.train)
                   for x, z in zip(a.clients, c.clients, strict=True))  # fmt: skip
    after = np.random.get_state()  # noqa: NPY002
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]


def test_label_validation_and_parameter_errors():
    with pytest.raises(UserError, match=r"invalid labels at rows \[1, 3\]"):
        partition_clients(np.array([0, -1, 1, -2]), scheme="iid", num_clients=2, seed=0)
    with pytest.raises(UserError, match=r"rows \[2\]"):
        partition_clients(np.array([0.0, 1.0, np.nan]), scheme="iid", num_clients=1, seed=0,
                          task="sst2")  # fmt: skip
    with pytest.raises(UserError, match="rows"):
        partition_clients(np.array([0.0, 1.5]), scheme="iid", num_clients=1, seed=0, task="rte")
    with pytest.raises(UserError, match=r"task rte has 2 classes but rows \[2\]"):
        partition_clients(np.array([0, 1, 2, 1]), scheme="iid", num_clients=1, seed=0, task="rte")
    with pytest.raises(UserError, match="unknown partition scheme"):
        partition_clients(np.zeros(4, int), scheme="zipf", num_clients=2, seed=0)
    with pytest.raises(UserError, match="needs --alpha"):
        partition_clients(np.zeros(4, int), scheme="dirichlet", num_clients=2, seed=0)
    with pytest.raises(UserError, match="needs class labels"):
        partition_clients(np.zeros(4, np.float32), scheme="dirichlet", alpha=1.0, num_clients=2,
                          seed=0, task="stsb")  # fmt: skip
    with pytest.raises(UserError, match="cannot fill 5 clients"):
        partition_clients(np.zeros(4, int), scheme="iid", num_clients=5, seed=0)


def test_client_without_training_examples_is_an_error():
    with pytest.raises(UserError, match="client 0 has no training examples"):
        partition_clients(np.zeros(5, int), scheme="iid", num_clients=5, seed=0, test_fraction=0.6)


def test_save_load_roundtrip_and_corrupt_files(tmp_path):
    y = _pool([60, 40])
    p = partition_clients(y, scheme="dirichlet", alpha=0.5, beta=3.0, num_clients=3, seed=9,
                          task="sst2")  # fmt: skip
    path = save_partition(p, tmp_path / "sub" / "partition.json")
    q = load_partition(path)
    assert (q.scheme, q.alpha, q.beta, q.seed, q.task, q.num_examples) == (
        "dirichlet", 0.5, 3.0, 9, "sst2", 100)  # fmt: skip
    for a, b in zip(p.clients, q.clients, strict=True):
        np.testing.assert_array_equal(a.train, b.train)
        np.testing.assert_array_equal(a.test, b.test)
    doc = json.loads(path.read_text())
    doc["clients"][1]["train"].append(doc["clients"][0]["test"][0])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="repeated or out-of-range"):
        load_partition(bad)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read partition file"):
        load_partition(tmp_path / "junk.json")
    doc = json.loads(path.read_text())
    del doc["dropped"]  # every field save_partition writes is needed
    bad.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="cannot read partition file .*'dropped'"):
        load_partition(bad)
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_partition_file_and_report_show_target_and_realised_shares(tmp_path):
    y = _pool([300, 500], seed=2)
    p = partition_clients(y, scheme="paper", num_clients=3, seed=0, task="rte")
    assert p.dropped > 0
    names = ["entailment", "not_entailment"]
    doc = json.loads(save_partition(p, tmp_path / "p.json", y, label_names=names).read_text())
    assert doc["fill"] == "exact" and doc["dropped"] == p.dropped
    assert doc["label_names"] == names  # the shares' columns
    np.testing.assert_allclose(doc["target_shares"], [[0.2, 0.8], [0.5, 0.5], [0.8, 0.2]])
    counts = _counts(p, y, 2)
    np.testing.assert_allclose(doc["realised_shares"], counts / counts.sum(1, keepdims=True),
                               atol=1e-6)  # fmt: skip
    q = load_partition(tmp_path / "p.json")
    assert (q.fill, q.dropped) == ("exact", p.dropped)
    np.testing.assert_allclose(q.target_shares, p.target_shares)
    text = partition_report(p, y, names)
    assert f"({p.dropped} left out" in text.splitlines()[0] and "fill=exact" in text
    assert "target 80%)" in text.splitlines()[2]  # client 0: 80% of class 1


def test_report_by_hand():
    y = np.array([0, 0, 1, 1, 1, 0, 1, 1, 1, 1])
    p = partition_clients(y, scheme="iid", num_clients=2, seed=0)
    text = partition_report(p, y, ["neg", "pos"])
    lines = text.splitlines()
    assert lines[0].startswith("partition iid K=2 seed=0") and "examples=10" in lines[0]
    assert lines[1].split() == ["client", "train", "test", "neg", "pos"]
    for j, c in enumerate(p.clients):
        neg = int(np.sum(y[c.all] == 0))
        cells = lines[2 + j].split()
        assert cells[:4] == [str(j), "4", "1", str(neg)]


def test_a_site_trains_on_its_train_file_and_tests_on_its_dev_file():
    from fedjax_split.data.partition import site_split

    splits = np.array(["train", "validation", "train", "train", "validation"])
    s = site_split(splits, 5, seed=0, client_id=2)
    assert s.train.tolist() == [0, 2, 3] and s.test.tolist() == [1, 4]
    # MNLI's two dev files are both test rows
    mnli = np.array(["train", "validation_matched", "validation_mismatched"])
    assert site_split(mnli, 3, seed=0, client_id=0).test.tolist() == [1, 2]


def test_a_site_without_a_dev_file_tests_on_a_fifth_drawn_from_its_seed_and_id_alone():
    from fedjax_split.data.partition import site_split

    a = site_split(np.array(["train"] * 23), 23, seed=5, client_id=1)
    assert (a.train.size, a.test.size) == (18, 5)  # round(23 / 5) test rows, as a partition's
    np.testing.assert_array_equal(np.sort(np.concatenate([a.train, a.test])), np.arange(23))
    assert np.all(np.diff(a.train) > 0) and np.all(np.diff(a.test) > 0)
    again = site_split(None, 23, seed=5, client_id=1)  # no file names: every row is train's
    np.testing.assert_array_equal(again.test, a.test)
    others = [site_split(None, 23, seed=s, client_id=c).test.tolist()
              for s, c in ((6, 1), (5, 2))]  # fmt: skip
    assert all(o != a.test.tolist() for o in others)


def test_sites_partition_offsets_each_site_by_the_sites_before_it_and_records_shares(tmp_path):
    from fedjax_split.data.partition import SITES, ClientSplit, sites_partition

    own = [ClientSplit(np.array([0, 1]), np.array([2])), ClientSplit(np.array([1]), np.array([0])),
           ClientSplit(np.array([0, 2, 3]), np.array([1]))]  # fmt: skip
    p = sites_partition(own, [3, 2, 4], seed=7, task="sst2")
    assert [(c.train.tolist(), c.test.tolist()) for c in p.clients] == [
        ([0, 1], [2]), ([4], [3]), ([5, 7, 8], [6])]  # fmt: skip
    assert (p.scheme, p.num_clients, p.num_examples, p.seed) == (SITES, 3, 9, 7)
    y = np.array([1, 1, 0, 0, 1, 0, 0, 0, 1])
    doc = json.loads(save_partition(p, tmp_path / "p.json", y,
                                    label_names=["negative", "positive"]).read_text())  # fmt: skip
    assert doc["scheme"] == "sites" and doc["target_shares"] is None
    np.testing.assert_allclose(doc["realised_shares"], [[1 / 3, 2 / 3], [0.5, 0.5], [0.75, 0.25]],
                               atol=1e-6)  # fmt: skip
    assert [len(c["train"]) for c in doc["clients"]] == [2, 1, 3]
    np.testing.assert_array_equal(load_partition(tmp_path / "p.json").clients[1].train, [4])
    assert "partition sites K=3" in partition_report(p, y, ["negative", "positive"])
    # scores (regression) have no shares
    doc = json.loads(save_partition(p, tmp_path / "q.json", y.astype(np.float32)).read_text())
    assert doc["realised_shares"] is None
