"""batching: contents against the ragged tokens, masks, coverage per epoch, determinism, waste."""

import math
from collections import Counter
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from fedjax_split.data.batching import (
    client_segments,
    make_client_batches,
    make_eval_batches,
    packed_shape,
    padding_waste,
)
from fedjax_split.data.objectives import REGRESSION


def _tokenized(lengths):
    # example j's token at position t is 7 * j + t + 1 (distinct per example), types 0 then 1
    ids = [np.arange(n, dtype=np.int32) + 7 * j + 1 for j, n in enumerate(lengths)]
    types = [(np.arange(n) >= n // 2).astype(np.int32) for n in lengths]
    return SimpleNamespace(input_ids=ids, token_type_ids=types,
                           lengths=np.asarray(lengths, np.int32))  # fmt: skip


def _setup(seed=0, sizes=(37, 20, 5), num=120):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(20), 0.5, num).astype(int), 3, 60)
    perm = rng.permutation(num)
    clients = np.split(perm[: sum(sizes)], np.cumsum(sizes)[:-1])
    labels = rng.integers(0, 3, num)
    return _tokenized(lengths), clients, labels, lengths


def _check_contents(segs, tok, labels, lengths, regression=False):
    for seg in segs:
        k, s, b, t = seg.input_ids.shape
        assert t % 8 == 0
        assert seg.labels.dtype == (np.float32 if regression else np.int32)
        assert seg.example_mask.dtype == np.float32 and seg.step_mask.dtype == bool
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            assert getattr(seg, name).dtype == np.int32
        idx = seg.example_index
        real = idx >= 0
        np.testing.assert_array_equal(seg.example_mask, real.astype(np.float32))
        # a step is real iff it holds a real example
        np.testing.assert_array_equal(seg.step_mask, real.any(-1))
        longest = lengths[idx[real]].max()
        assert t >= math.ceil(longest / 8) * 8
        for i, j, r in zip(*np.nonzero(real), strict=True):
            e = idx[i, j, r]
            n = lengths[e]
            np.testing.assert_array_equal(seg.input_ids[i, j, r, :n], tok.input_ids[e])
            np.testing.assert_array_equal(seg.token_type_ids[i, j, r, :n], tok.token_type_ids[e])
            assert not seg.input_ids[i, j, r, n:].any()
            assert seg.attention_mask[i, j, r].tolist() == [1] * n + [0] * (t - n)
            assert seg.labels[i, j, r] == labels[e]
        pad = ~real
        assert not seg.input_ids[pad].any() and not seg.labels[pad].any()
        assert (seg.attention_mask[pad].sum(-1) == 1).all()  # position 0 only, no empty row
        assert (seg.attention_mask[pad][:, 0] == 1).all()


def _check_tight_widths(segs, lengths):
    """A bucket keeps one (S, T) in all epochs; T is its longest example rounded up to 8."""
    widest: dict = {}
    for seg in segs:
        idx = seg.example_index
        need = math.ceil(lengths[idx[idx >= 0]].max() / 8) * 8
        shape = seg.input_ids.shape
        widest[shape] = max(widest.get(shape, 0), need)
    assert all(shape[3] == need for shape, need in widest.items())


def _per_client_rows(segs):
    k = segs[0].input_ids.shape[0]
    return [np.concatenate([s.example_index[i].reshape(-1) for s in segs]) for i in range(k)]


@pytest.mark.parametrize("bucketing", [True, False])
def test_every_example_epochs_times_and_contents(bucketing):
    tok, clients, labels, lengths = _setup()
    epochs, batch = 3, 4
    segs = make_client_batches(tok, clients, labels, batch_size=batch, epochs=epochs, seed=5,
                               bucketing=bucketing, num_buckets=3, window=2)  # fmt: skip
    _check_contents(segs, tok, labels, lengths)
    _check_tight_widths(segs, lengths)
    assert len(segs) % epochs == 0 if bucketing else len(segs) == 1
    per_epoch = len(segs) // epochs
    for i, ix in enumerate(clients):
        rows = _per_client_rows(segs)[i]
        rows = rows[rows >= 0]
        assert np.array_equal(np.sort(rows), np.sort(np.tile(ix, epochs)))
        real_steps = sum(int(s.step_mask[i].sum()) for s in segs)
        assert real_steps == epochs * math.ceil(ix.size / batch)
        if bucketing:  # each epoch's group of segments holds every example exactly once
            for e in range(epochs):
                got = _per_client_rows(segs[e * per_epoch : (e + 1) * per_epoch])[i]
                assert np.array_equal(np.sort(got[got >= 0]), np.sort(ix))
        # only one partial batch per epoch
        partial = sum(int(((s.example_index[i] >= 0).sum(-1) % batch != 0).sum()) for s in segs)
        assert partial == (epochs if ix.size % batch else 0)
    if not bucketing:
        (seg,) = segs
        assert seg.input_ids.shape[:3] == (3, epochs * math.ceil(37 / batch), batch)
        # the 5-example client has 2 real steps per epoch and then masked steps only
        np.testing.assert_array_equal(seg.step_mask[2], np.arange(seg.step_mask.shape[1]) < 6)
        first_epoch = seg.example_index[0, : math.ceil(37 / batch)].reshape(-1)
        assert np.array_equal(np.sort(first_epoch[first_epoch >= 0]), np.sort(clients[0]))


def test_bucketed_segments_share_shapes_across_epochs_and_cut_padding():
    tok, clients, labels, lengths = _setup(sizes=(60, 50, 10))
    kw = dict(batch_size=4, epochs=2, seed=1)
    segs = make_client_batches(tok, clients, labels, num_buckets=4, **kw)
    shapes = [s.input_ids.shape for s in segs]
    assert sorted(shapes[: len(shapes) // 2]) == sorted(shapes[len(shapes) // 2 :])
    assert len({s[3] for s in shapes}) > 1  # several widths
    flat = make_client_batches(tok, clients, labels, bucketing=False, **kw)
    assert padding_waste(segs) < padding_waste(flat)


def test_determinism_seed_and_global_state():
    tok, clients, labels, _ = _setup()
    before = np.random.get_state()  # noqa: NPY002 - checking it is untouched
    a = make_client_batches(tok, clients, labels, batch_size=4, epochs=2, seed=[3, 1])
    b = make_client_batches(tok, clients, labels, batch_size=4, epochs=2, seed=[3, 1])
    c = make_client_batches(tok, clients, labels, batch_size=4, epochs=2, seed=[3, 2])
    after = np.random.get_state()  # noqa: NPY002
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert jax.tree.structure(x) == jax.tree.structure(y)
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
            np.testing.assert_array_equal(u, v)
    assert any(x.example_index.shape != y.example_index.shape
               or not np.array_equal(x.example_index, y.example_index)
               for x, y in zip(a, c, strict=False))  # fmt: skip
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]


def test_client_ids_key_the_shuffle():
    tok, clients, labels, _ = _setup(sizes=(30, 30))
    kw = dict(batch_size=4, epochs=1, seed=3, bucketing=False)
    ab = make_client_batches(tok, clients, labels, client_ids=[7, 9], **kw)[0]
    ba = make_client_batches(tok, clients[::-1], labels, client_ids=[9, 7], **kw)[0]
    np.testing.assert_array_equal(ab.example_index[0], ba.example_index[1])
    pos = make_client_batches(tok, clients, labels, **kw)[0]
    assert not np.array_equal(pos.example_index[0], ab.example_index[0])


def test_no_shuffle_is_seed_independent():
    tok, clients, labels, _ = _setup()
    a = make_client_batches(tok, clients, labels, batch_size=4, epochs=1, seed=1, shuffle=False)
    b = make_client_batches(tok, clients, labels, batch_size=4, epochs=1, seed=2, shuffle=False)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.example_index, y.example_index)


def test_regression_labels_and_max_length_cap():
    lengths = [3, 9, 10, 5]
    tok = _tokenized(lengths)
    scores = np.array([0.5, 4.75, 2.0, 3.25], np.float32)
    segs = make_client_batches(tok, [np.array([0, 1]), np.array([2, 3])], scores, batch_size=2,
                               epochs=1, seed=0, objective=REGRESSION, bucketing=False,
                               max_length=12)  # fmt: skip
    (seg,) = segs
    assert seg.input_ids.shape == (2, 1, 2, 12)  # 16 capped at 12
    assert seg.labels.dtype == np.float32
    index, values = seg.example_index.reshape(-1), seg.labels.reshape(-1)
    got = {int(i): float(v) for i, v in zip(index, values, strict=True)}
    assert got == {0: 0.5, 1: 4.75, 2: 2.0, 3: 3.25}


@pytest.mark.parametrize("bucketing", [True, False])
def test_client_without_examples_gets_only_masked_steps(bucketing):
    tok = _tokenized([3, 5, 7])
    segs = make_client_batches(tok, [np.array([0, 1, 2]), np.array([], np.int64)], np.zeros(3, int),
                               batch_size=2, epochs=2, seed=0, bucketing=bucketing)  # fmt: skip
    assert sum(int(s.step_mask[0].sum()) for s in segs) == 4
    assert not any(s.step_mask[1].any() or s.example_mask[1].any() for s in segs)


def test_fractional_class_labels_are_rejected():
    tok = _tokenized([3, 4])
    with pytest.raises(ValueError, match="objective=REGRESSION"):
        make_client_batches(tok, [np.array([0, 1])], np.array([0.5, 1.0]), batch_size=2,
                            epochs=1, seed=0)  # fmt: skip


def test_eval_batches_once_each_sorted_by_length():
    tok, clients, labels, lengths = _setup()
    segs = make_eval_batches(tok, clients, labels, batch_size=4, num_buckets=3)
    _check_contents(segs, tok, labels, lengths)
    _check_tight_widths(segs, lengths)
    for i, ix in enumerate(clients):
        rows = _per_client_rows(segs)[i]
        rows = rows[rows >= 0]
        assert np.array_equal(np.sort(rows), np.sort(ix))
        assert np.all(np.diff(lengths[rows]) >= 0)  # no shuffle: ascending length


@pytest.mark.parametrize("batch_size", [8, 32, 64])
def test_clients_smaller_than_one_batch(batch_size):
    # Regression: a window holding fewer examples than one batch produced an empty batch.
    tok, clients, labels, lengths = _setup(sizes=(7, 3, 1))
    for epochs, segs in (
        (1, make_eval_batches(tok, clients, labels, batch_size=batch_size)),
        (2, make_client_batches(tok, clients, labels, batch_size=batch_size, epochs=2, seed=0)),
    ):
        _check_contents(segs, tok, labels, lengths)
        for i, ix in enumerate(clients):
            rows = _per_client_rows(segs)[i]
            assert np.array_equal(np.sort(rows[rows >= 0]), np.sort(np.tile(ix, epochs)))


def test_padding_waste_by_hand():
    tok = _tokenized([3, 8, 5])
    segs = make_client_batches(tok, [np.array([0, 1]), np.array([2])], np.zeros(3, int),
                               batch_size=2, epochs=1, seed=0, bucketing=False)  # fmt: skip
    # computed: K=2 x S=1 x B=2 x T=8 = 32 positions; real tokens 3 + 8 + 5 = 16
    assert padding_waste(segs) == pytest.approx(0.5, abs=0)


@pytest.mark.slow
def test_padding_waste_under_15_percent_on_real_rotten_tomatoes():
    from fedjax_split.data.partition import partition_clients
    from fedjax_split.data.sources import load_examples
    from fedjax_split.data.tokenization import load_tokenizer, tokenize

    ex = load_examples("rotten_tomatoes")
    tok = tokenize(load_tokenizer("minilm-l6"), ex.texts_a, max_length=128)
    assert 20 < tok.lengths.mean() < 35  # about 27 word pieces with [CLS]/[SEP]
    part = partition_clients(
        ex.labels, scheme="paper", num_clients=3, seed=0, task="rotten_tomatoes"
    )
    train = [c.train for c in part.clients]
    for batch in (8, 16, 32):
        segs = make_client_batches(tok, train, ex.labels, batch_size=batch, epochs=3, seed=0)
        flat = make_client_batches(tok, train, ex.labels, batch_size=batch, epochs=3, seed=0,
                                   bucketing=False)  # fmt: skip
        assert padding_waste(segs) < 0.15, (batch, padding_waste(segs))
        assert padding_waste(flat) > 0.5


# ----------------------------------------------------------------------------- packing


def _sentence_pool(n: int, seed: int = 0):
    """Sentence-like lengths (median ~25, long tail to 90), pair-free, with [CLS]=1 first."""
    from fedjax_split.data.tokenization import Tokenized

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(3.2, 0.45, n)), 3, 90).astype(np.int64)
    ids = [np.concatenate([[1], rng.integers(5, 999, k - 1)]).astype(np.int32) for k in lengths]
    types = [(np.arange(k) >= k // 2).astype(np.int32) for k in lengths]
    return Tokenized(ids, types, lengths.astype(np.int32)), ids, types


def test_packed_segments_hold_every_example_once_intact() -> None:
    tok, ids, types = _sentence_pool(300)
    clients = [np.arange(0, 90), np.arange(90, 140), np.arange(140, 300)]
    labels = np.arange(300) % 3
    segs = make_client_batches(
        tok, clients, labels, batch_size=8, epochs=2, seed=5, packing=True, pack_width=64
    )
    seen = []  # (client position, pool index) of every real example
    shapes = set()
    for seg in segs:
        k, s, n = seg.input_ids.shape
        r, w = seg.attention_mask.shape[2:]
        shapes.add((s, n, r, w))
        assert w >= 64 and seg.cls_index.shape == (k, s, 8)
        seen += _packed_examples(seg, ids, types, labels)
    # two epochs: every client's example exactly twice
    counts = Counter(seen)
    assert set(counts.values()) == {2}
    assert {ix for _, ix in counts} == set(range(300))
    assert all(ix in clients[c] for c, ix in counts)
    # every bucket keeps one shape in both epochs (one compilation each)
    per_epoch = len(segs) // 2
    first = sorted(_packed_shape(s) for s in segs[:per_epoch])
    assert first == sorted(_packed_shape(s) for s in segs[per_epoch:])
    assert shapes == set(first)


def _packed_examples(seg, ids, types, labels) -> list[tuple[int, int]]:
    """Checks that every real example of a packed segment lies intact in its stream and in one
    attention row; returns (client position, pool index) of each."""
    seen = []
    k, s, _ = seg.input_ids.shape
    w = seg.attention_mask.shape[-1]
    for c in range(k):
        for j in range(s):
            slots = seg.attention_mask[c, j].reshape(-1)
            rows, back = seg.row_tokens[c, j].reshape(-1), seg.token_slots[c, j]
            used = np.nonzero(slots)[0]
            np.testing.assert_array_equal(back[rows[used]], used)  # slots <-> stream
            for e in np.nonzero(seg.example_mask[c, j])[0]:
                ix = seg.example_index[c, j, e]
                start, m = seg.cls_index[c, j, e], len(ids[ix])
                stream = slice(start, start + m)
                assert start + m <= seg.input_ids.shape[-1]
                np.testing.assert_array_equal(seg.input_ids[c, j, stream], ids[ix])
                np.testing.assert_array_equal(seg.token_type_ids[c, j, stream], types[ix])
                np.testing.assert_array_equal(seg.position_ids[c, j, stream], np.arange(m))
                # one example's tokens share a row and carry its slot number
                where = back[stream]
                assert len(set(where // w)) == 1
                assert np.all(slots[where] == e + 1)
                assert seg.labels[c, j, e] == labels[ix]
                seen.append((c, int(ix)))
    return seen


def test_client_segments_cut_packed_parts_to_the_smallest_shape_that_holds_them() -> None:
    tok, ids, types = _sentence_pool(300)
    clients = [np.arange(0, 90), np.arange(90, 140), np.arange(140, 300), np.arange(0)]
    labels = np.arange(300) % 3
    segs = make_client_batches(
        tok, clients, labels, batch_size=8, epochs=2, seed=5, packing=True, pack_width=64
    )
    shapes = {packed_shape(s) for s in segs}
    assert len(shapes) > 1
    cut = 0
    for seg, parts in zip(segs, client_segments(segs), strict=True):
        assert len(parts) == 4 and parts[3] is None  # the empty client has no real step
        s, n, r = packed_shape(seg)
        for c, part in enumerate(parts[:3]):
            real = seg.step_mask[c] & (seg.example_mask[c].sum(-1) > 0)
            if not real.any():
                assert part is None
                continue
            # the same examples, intact, in the same steps and slots
            here = _packed_examples(part, ids, types, labels)
            alone = jax.tree.map(lambda value, c=c: value[c : c + 1], seg)
            assert here == _packed_examples(alone, ids, types, labels)
            assert len(here) == int(seg.example_mask[c].sum())
            for key in ("labels", "example_mask", "step_mask", "cls_index", "example_index"):
                np.testing.assert_array_equal(getattr(part, key)[0], getattr(seg, key)[c])
            # cut to the smallest of the round's shapes (nothing new to compile) that holds it
            slots = seg.attention_mask[c][real] > 0
            tokens, used = slots.sum(axis=(1, 2)).max(), slots.any(axis=2).sum(axis=1).max()
            fits = [x for x in shapes if x[0] == s and x[1] >= tokens and x[2] >= used]
            assert packed_shape(part) == min(fits)
            assert part.row_tokens.shape == part.attention_mask.shape
            cut += packed_shape(part)[1] < n
    assert cut > 0
    whole = padding_waste(segs, skip_masked_steps=True)
    parts = [p for ps in client_segments(segs) for p in ps if p is not None]
    assert padding_waste(parts, skip_masked_steps=True) < whole


def test_client_segments_keep_padded_parts_whole() -> None:
    tok, clients, labels, _ = _setup()
    segs = make_client_batches(tok, clients, labels, batch_size=4, epochs=1, seed=0)
    for seg, parts in zip(segs, client_segments(segs), strict=True):
        for c, part in enumerate(parts):
            if part is None:
                assert not np.any(seg.step_mask[c] & (seg.example_mask[c].sum(-1) > 0))
                continue
            assert type(part) is type(seg)
            assert jax.tree.structure(part) == jax.tree.structure(seg)
            for u, v in zip(jax.tree.leaves(part), jax.tree.leaves(seg), strict=True):
                np.testing.assert_array_equal(u, v[c : c + 1])


def _packed_shape(seg) -> tuple[int, ...]:
    return seg.input_ids.shape[1:] + seg.attention_mask.shape[2:]


def test_packing_cuts_padding_below_15_percent() -> None:
    tok, _, _ = _sentence_pool(1000, seed=1)
    clients = np.array_split(np.random.default_rng(2).permutation(1000), 10)
    labels = np.zeros(1000, np.int64)
    kw = dict(batch_size=16, epochs=2, seed=0)
    padded = padding_waste(make_client_batches(tok, clients, labels, **kw))
    packed = padding_waste(make_client_batches(tok, clients, labels, packing=True, **kw))
    assert packed < 0.15 < padded, (packed, padded)


def test_padding_waste_can_skip_masked_steps() -> None:
    tok, _, _ = _sentence_pool(40)
    segs = make_client_batches(
        tok, [np.arange(0, 32), np.arange(32, 40)], np.zeros(40, np.int64), batch_size=8,
        epochs=1, seed=0, bucketing=False, pad_to_multiple=1,
    )  # fmt: skip
    (seg,) = segs
    assert seg.step_mask.sum() == 5 and seg.step_mask.size == 8
    t = seg.input_ids.shape[-1]
    real = sum(len(x) for x in tok.input_ids)
    assert padding_waste(segs) == pytest.approx(1 - real / (8 * 8 * t))
    assert padding_waste(segs, skip_masked_steps=True) == pytest.approx(1 - real / (5 * 8 * t))


@pytest.mark.parametrize("packing", [False, True])
def test_token_labels_follow_their_tokens(packing: bool) -> None:
    """A token task's labels travel with the tokens: padded [K, S, B, T] or packed [K, S, N]
    streams, IGNORE on every padding position; the per-example labels are not used."""
    from fedjax_split.data.objectives import IGNORE, TOKEN_CLASSIFICATION

    lengths = [3, 9, 5, 7, 4]
    tok = _tokenized(lengths)
    # example j's token t has label 100 * j + t: distinct, so any misplacement shows
    tok.labels = [100 * j + np.arange(n, dtype=np.int32) for j, n in enumerate(lengths)]
    clients = [np.array([0, 1, 2]), np.array([3, 4])]
    segs = make_client_batches(
        tok, clients, np.zeros(5, int), batch_size=2, epochs=1, seed=3,
        objective=TOKEN_CLASSIFICATION, packing=packing, pack_width=16,
    )  # fmt: skip
    seen = {}
    for seg in segs:
        labels, ids = seg.labels, seg.input_ids
        assert labels.shape == ids.shape and labels.dtype == np.int32
        real = labels != IGNORE
        np.testing.assert_array_equal(
            ids[real] - 1, (labels[real] % 100) + 7 * (labels[real] // 100)
        )
        for value in labels[real]:
            seen[int(value)] = seen.get(int(value), 0) + 1
    assert seen == {100 * j + t: 1 for j, n in enumerate(lengths) for t in range(n)}
    with pytest.raises(ValueError, match="per-token labels"):
        make_client_batches(tok, clients, np.zeros(5, int), batch_size=2, epochs=1, seed=0)
