"""metrics: hand-computed values, scipy.stats and closed forms (scipy in tests only)."""

import numpy as np
import pytest
import scipy.stats

from fedjax_split.tasks import metrics


def test_accuracy_and_f1_by_hand():
    y = np.array([1, 1, 1, 0, 0, 0, 1, 0])
    p = np.array([1, 0, 1, 1, 0, 0, 1, 1])
    # TP=3 (0,2,6), FN=1 (1), FP=2 (3,7), TN=2 (4,5)
    assert metrics.accuracy(p, y) == 5 / 8
    assert metrics.f1(p, y) == pytest.approx(2 * 3 / (2 * 3 + 2 + 1), abs=0)
    # positive = 0: TP=2, FP=1 (1), FN=2 (3,7)
    assert metrics.f1(p, y, positive=0) == pytest.approx(4 / 7, abs=0)


def test_f1_without_any_positive_is_zero():
    assert metrics.f1(np.zeros(4, int), np.zeros(4, int)) == 0.0


def test_matthews_binary_by_hand():
    y = np.array([1, 1, 1, 0, 0, 0, 1, 0])
    p = np.array([1, 0, 1, 1, 0, 0, 1, 1])
    tp, tn, fp, fn = 3, 2, 2, 1
    expected = (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert metrics.matthews_corrcoef(p, y) == pytest.approx(expected, rel=1e-15)


def test_matthews_degenerate_and_perfect():
    y = np.array([0, 1, 1, 0])
    assert metrics.matthews_corrcoef(np.ones(4, int), y) == 0.0
    assert metrics.matthews_corrcoef(y, y) == 1.0
    assert metrics.matthews_corrcoef(1 - y, y) == -1.0


def test_matthews_multiclass_against_covariance_definition():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 200)
    p = np.where(rng.random(200) < 0.6, y, rng.integers(0, 3, 200))
    # MCC = cov(X, Y) / sqrt(cov(X, X) cov(Y, Y)) over one-hot encodings (Gorodkin 2004)
    x1, y1 = np.eye(3)[p], np.eye(3)[y]
    xc, yc = x1 - x1.mean(0), y1 - y1.mean(0)
    expected = np.sum(xc * yc) / np.sqrt(np.sum(xc * xc) * np.sum(yc * yc))
    assert metrics.matthews_corrcoef(p, y) == pytest.approx(expected, rel=1e-12)


def test_pearson_spearman_against_scipy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=300)
    y = 0.5 * x + rng.normal(size=300)
    assert metrics.pearson(x, y) == pytest.approx(scipy.stats.pearsonr(x, y)[0], rel=1e-12)
    # heavy ties: scores rounded to 0.5 like STS-B annotations
    xt, yt = np.round(x * 2) / 2, np.round(y * 2) / 2
    assert metrics.spearman(xt, yt) == pytest.approx(scipy.stats.spearmanr(xt, yt)[0], rel=1e-12)
    assert metrics.spearman(x, y) == pytest.approx(scipy.stats.spearmanr(x, y)[0], rel=1e-12)


def test_average_ranks_by_hand_and_scipy():
    x = np.array([10.0, 20.0, 10.0, 30.0, 20.0, 20.0])
    np.testing.assert_array_equal(metrics.average_ranks(x), [1.5, 4.0, 1.5, 6.0, 4.0, 4.0])
    r = np.random.default_rng(2).integers(0, 5, 50)
    np.testing.assert_array_equal(metrics.average_ranks(r), scipy.stats.rankdata(r))


def test_pearson_by_hand_and_constant_is_nan():
    # x = [1,2,3], y = [1,3,2]: cov = 0.5*... -> r = 0.5
    assert metrics.pearson(np.array([1, 2, 3]), np.array([1, 3, 2])) == pytest.approx(
        0.5, rel=1e-15
    )
    assert np.isnan(metrics.pearson(np.ones(3), np.array([1.0, 2.0, 3.0])))


def test_length_mismatch_and_empty_raise():
    with pytest.raises(ValueError):
        metrics.accuracy(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError):
        metrics.accuracy(np.zeros(0), np.zeros(0))
