"""batching: each client's steps from its own examples (contents, masks, coverage per epoch,
plain shuffling, shapes, determinism), stacking for vmap, evaluation batches, padding waste."""

import itertools
import math
from collections import Counter
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from fedjax_split.data.batching import (
    Batching,
    client_batches,
    client_eval_batches,
    default_row_width,
    make_client_batches,
    padding_waste,
    stack_clients,
)
from fedjax_split.tasks.objectives import IGNORE, REGRESSION, TOKEN_CLASSIFICATION


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


def _rows(steps) -> np.ndarray:
    """Pool indices of a client's real rows, step after step."""
    index = np.concatenate([s.example_index.reshape(-1) for s in steps])
    return index[index >= 0]


def _check_padded(steps, tok, labels, lengths):
    """Every real row holds its example's tokens, label and masks; padding is inert."""
    for step in steps:
        s, b, t = step.input_ids.shape
        assert s == 1 and t % 8 == 0 and not step.packed
        assert step.labels.dtype == np.int32 and step.example_mask.dtype == np.float32
        assert step.step_mask.dtype == bool and step.step_mask.tolist() == [True]
        idx = step.example_index
        real = idx >= 0
        np.testing.assert_array_equal(step.example_mask, real.astype(np.float32))
        assert t >= math.ceil(lengths[idx[real]].max() / 8) * 8
        for i, r in zip(*np.nonzero(real), strict=True):
            e, n = idx[i, r], lengths[idx[i, r]]
            np.testing.assert_array_equal(step.input_ids[i, r, :n], tok.input_ids[e])
            np.testing.assert_array_equal(step.token_type_ids[i, r, :n], tok.token_type_ids[e])
            assert not step.input_ids[i, r, n:].any()
            assert step.attention_mask[i, r].tolist() == [1] * n + [0] * (t - n)
            assert step.labels[i, r] == labels[e]
        pad = ~real
        assert not step.input_ids[pad].any() and not step.labels[pad].any()
        assert (step.attention_mask[pad].sum(-1) == 1).all()  # position 0 only, no empty row
        assert (step.attention_mask[pad][:, 0] == 1).all()


@pytest.mark.parametrize("bucketing", [False, True])
def test_every_example_once_per_epoch_and_contents(bucketing):
    tok, clients, labels, lengths = _setup()
    epochs, batch = 3, 4
    for cid, ix in enumerate(clients):
        how = Batching(batch, packing=False, bucketing=bucketing, window=2)
        steps = client_batches(tok, ix, labels, how, epochs=epochs, seed=5, client_id=cid)
        _check_padded(steps, tok, labels, lengths)
        per_epoch = math.ceil(ix.size / batch)
        assert len(steps) == epochs * per_epoch
        for e in range(epochs):
            got = _rows(steps[e * per_epoch : (e + 1) * per_epoch])
            assert np.array_equal(np.sort(got), np.sort(ix))
        # only one partial batch per epoch
        partial = sum(int((s.example_index >= 0).sum() % batch != 0) for s in steps)
        assert partial == (epochs if ix.size % batch else 0)
        if bucketing and ix.size > 8:  # batches of similar length: sorted windows of 2
            spread = [np.ptp(lengths[s.example_index[s.example_index >= 0]]) for s in steps]
            plain = client_batches(tok, ix, labels, Batching(batch, packing=False),
                                   epochs=epochs, seed=5, client_id=cid)  # fmt: skip
            plain_spread = [np.ptp(lengths[s.example_index[s.example_index >= 0]]) for s in plain]
            assert np.mean(spread) < np.mean(plain_spread)


def test_a_clients_steps_depend_on_its_own_examples_seed_and_id_only():
    tok, clients, labels, _ = _setup(sizes=(30, 30, 12))
    how, kw = Batching(4, packing=True), dict(epochs=2, seed=[3, 1])
    alone = client_batches(tok, clients[1], labels, how, client_id=9, **kw)
    # stacked with other companions, in another position, client 9 gets the very same steps
    for companions, pos in (([clients[0]], 1), ([clients[2], clients[0]], 0)):
        ix = list(companions)
        ix.insert(pos, clients[1])
        ids = [7, 8][: len(companions)]
        ids.insert(pos, 9)
        stacked = make_client_batches(tok, ix, labels, how, client_ids=ids, **kw)
        assert len(stacked) >= len(alone)
        for j, step in enumerate(alone):
            mine = jax.tree.map(lambda v, pos=pos, j=j: v[pos], stacked[j])
            n, r = step.input_ids.shape[-1], step.attention_mask.shape[-2]
            cut = mine.replace(
                **{f: getattr(mine, f)[..., :n] for f in
                   ("input_ids", "token_type_ids", "position_ids", "token_slots")},
                attention_mask=mine.attention_mask[..., :r, :],
                row_tokens=mine.row_tokens[..., :r, :],
            )  # fmt: skip
            for a, b in zip(jax.tree.leaves(step), jax.tree.leaves(cut), strict=True):
                np.testing.assert_array_equal(a, b)
            # what was grown is padding only
            assert not mine.attention_mask[..., r:, :].any()
            assert not mine.input_ids[..., n:].any()
    # another id or another seed reorders; the same id and seed repeat exactly
    again = client_batches(tok, clients[1], labels, how, client_id=9, **kw)
    assert all(np.array_equal(a.example_index, b.example_index)
               for a, b in zip(alone, again, strict=True))  # fmt: skip
    other_id = client_batches(tok, clients[1], labels, how, client_id=8, **kw)
    other_seed = client_batches(tok, clients[1], labels, how, client_id=9, **{**kw, "seed": [3, 2]})
    for other in (other_id, other_seed):
        assert not np.array_equal(_rows(alone), _rows(other))


def test_the_global_numpy_generator_is_never_touched():
    tok, clients, labels, _ = _setup()
    before = np.random.get_state()  # noqa: NPY002 - checking it is untouched
    client_batches(tok, clients[0], labels, Batching(4), epochs=2, seed=1)
    after = np.random.get_state()  # noqa: NPY002
    assert before[0] == after[0] and np.array_equal(before[1], after[1]) and before[2:] == after[2:]


def test_no_shuffle_is_seed_independent():
    tok, clients, labels, _ = _setup()
    a = client_batches(tok, clients[0], labels, Batching(4, shuffle=False), epochs=1, seed=1)
    b = client_batches(tok, clients[0], labels, Batching(4, shuffle=False), epochs=1, seed=2)
    np.testing.assert_array_equal(_rows(a), _rows(b))
    np.testing.assert_array_equal(_rows(a), clients[0])


def test_the_settings_are_a_frozen_hashable_value():
    """One `Batching` serves every client and round of a run: a value (equal settings, equal
    specs, one hash), which nothing can change under the clients' feet."""
    import dataclasses

    how = Batching(16)
    assert how == Batching(16, packing=True, shuffle=True, window=200, row_width=None)
    assert hash(how) == hash(Batching(16)) and {how: 1}[Batching(16)] == 1
    assert how != Batching(16, packing=False) and how != Batching(8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        how.batch_size = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="batch_size"):
        client_batches(_tokenized([3]), np.array([0]), np.zeros(1, int), Batching(0), epochs=1,
                       seed=0)  # fmt: skip


def test_default_settings_pack_one_step_as_by_hand():
    """Two examples of 3 and 5 tokens in one packed step under the default settings: W is the
    64 floor, N the ladder size of a quarter of B full rows (2 * 64 / 4 = 32), R = N / W + 1;
    first-fit decreasing puts the longer example first in row 0."""
    tok = _tokenized([3, 5])  # ids [1, 2, 3] and [8, 9, 10, 11, 12]
    labels = np.array([2, 1])
    zeros = [0] * 24
    for how in (Batching(2, shuffle=False), Batching(2)):
        (step,) = client_batches(tok, np.array([0, 1]), labels, how, epochs=1, seed=0)
        assert step.packed and step.input_ids.shape == (1, 32)
        assert step.attention_mask.shape == (1, 2, 64) and step.row_tokens.shape == (1, 2, 64)
        assert step.input_ids[0].tolist() == [8, 9, 10, 11, 12, 1, 2, 3] + zeros
        assert step.token_type_ids[0].tolist() == [0, 0, 1, 1, 1, 0, 1, 1] + zeros
        assert step.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2] + zeros
        assert step.token_slots[0].tolist() == list(range(8)) + zeros
        assert step.row_tokens[0].tolist() == [list(range(8)) + [0] * 56, [0] * 64]
        (index,) = step.example_index.tolist()
        if not how.shuffle:
            assert index == [0, 1]  # the client's order
        assert sorted(index) == [0, 1]
        s0, s1 = index.index(0), index.index(1)  # batch slots of the two examples
        row = [s1 + 1] * 5 + [s0 + 1] * 3 + [0] * 56
        assert step.attention_mask[0].tolist() == [row, [0] * 64]
        assert step.cls_index[0, s1] == 0 and step.cls_index[0, s0] == 5
        assert step.labels.dtype == np.int32 and step.labels[0].tolist() == labels[index].tolist()
        assert step.example_mask.tolist() == [[1.0, 1.0]] and step.step_mask.tolist() == [True]


def _pair_repeats(steps_by_epoch: list[list]) -> float:
    """Share of the pairs of examples that share a batch in one epoch and again in the next."""
    def pairs(steps):
        out = set()
        for s in steps:
            rows = np.sort(s.example_index[s.example_index >= 0])
            out.update(itertools.combinations(rows.tolist(), 2))
        return out

    shared = [pairs(e) for e in steps_by_epoch]
    again = sum(len(a & b) for a, b in itertools.pairwise(shared))
    return again / sum(len(a) for a in shared[:-1])


def test_plain_shuffling_by_default_pairs_rarely_meet_again():
    """Algorithm 1's random mini-batches: two examples that shared a batch meet again in the
    next epoch about as often as chance (B - 1) / (n - 1); length-sorted windows (bucketing) make
    batches repeat their membership."""
    tok, _, _ = _sentence_pool(400, seed=3)
    ix, labels, epochs, batch = np.arange(400), np.zeros(400, np.int64), 4, 16
    per_epoch = math.ceil(400 / batch)

    def by_epoch(**kw):
        steps = client_batches(tok, ix, labels, Batching(batch, **kw), epochs=epochs, seed=0)
        return [steps[e * per_epoch : (e + 1) * per_epoch] for e in range(epochs)]

    plain = _pair_repeats(by_epoch())
    chance = (batch - 1) / (400 - 1)
    assert plain < 2 * chance, (plain, chance)
    bucketed = _pair_repeats(by_epoch(packing=False, bucketing=True))
    assert bucketed > 10 * chance, (bucketed, chance)


def _ladder(x: int) -> int:
    """x rounded up to 4 points per power of two, in multiples of 8 (written again here)."""
    step = max(8, 2 ** (x.bit_length() - 1) // 4)
    return -(-x // step) * step


def test_step_shapes_come_from_a_ladder_and_recur():
    tok, _, _ = _sentence_pool(1000, seed=4)
    labels = np.zeros(1000, np.int64)
    rng = np.random.default_rng(0)
    shapes = set()
    for r in range(3):
        for cid, ix in enumerate(np.array_split(rng.permutation(1000), 10)):
            steps = client_batches(tok, ix, labels, Batching(16), epochs=1, seed=[0, r],
                                   client_id=cid)  # fmt: skip
            for s in steps:
                n, (rows, width) = s.input_ids.shape[-1], s.attention_mask.shape[-2:]
                real = int((s.attention_mask > 0).sum())
                used = int((s.attention_mask[0] > 0).any(-1).sum())  # rows first-fit filled
                assert real <= n and n % 8 == 0 and n == _ladder(n)  # on the ladder
                # the smallest ladder size that holds the tokens and a quarter of B full rows,
                # unless the rows that size brings (one more than it needs) are too few
                base = _ladder(max(real, 16 * width // 4))
                assert n == base or used > -(-base // width) + 1
                assert rows == -(-n // width) + 1  # R follows N
                shapes.add((n, rows))
    assert len(shapes) <= 8, sorted(shapes)  # 30 clients' rounds, a handful of programs


def test_regression_labels_and_max_length_cap():
    lengths = [3, 9, 10, 5]
    tok = _tokenized(lengths)
    scores = np.array([0.5, 4.75, 2.0, 3.25], np.float32)
    how = Batching(4, objective=REGRESSION, packing=False, max_length=12)
    steps = client_batches(tok, np.array([0, 1, 2, 3]), scores, how, epochs=1, seed=0)
    (step,) = steps
    assert step.input_ids.shape == (1, 4, 12)  # 16 capped at 12
    assert step.labels.dtype == np.float32
    index, values = step.example_index.reshape(-1), step.labels.reshape(-1)
    got = {int(i): float(v) for i, v in zip(index, values, strict=True)}
    assert got == {0: 0.5, 1: 4.75, 2: 2.0, 3: 3.25}


def test_client_without_examples_has_no_steps_and_gets_masked_ones_when_stacked():
    tok = _tokenized([3, 5, 7])
    kw = dict(epochs=2, seed=0)
    for packing in (False, True):
        how = Batching(2, packing=packing)
        empty = client_batches(tok, np.array([], np.int64), np.zeros(3, int), how, **kw)
        assert empty == []
        full = client_batches(tok, np.array([0, 1, 2]), np.zeros(3, int), how, **kw)
        stacked = stack_clients([full, empty])
        assert len(stacked) == 4 and sum(int(s.step_mask[0].sum()) for s in stacked) == 4
        assert not any(s.step_mask[1].any() or s.example_mask[1].any() for s in stacked)
        assert all((s.example_index[1] == -1).all() for s in stacked)
        if not packing:  # padding rows attend to position 0 only
            assert all((s.attention_mask[1][..., 0] == 1).all() for s in stacked)


def test_bad_labels_and_mixed_kinds_are_refused():
    tok = _tokenized([3, 4])
    with pytest.raises(ValueError, match="objective=REGRESSION"):
        client_batches(tok, np.array([0, 1]), np.array([0.5, 1.0]), Batching(2), epochs=1,
                       seed=0)  # fmt: skip
    padded = client_batches(tok, np.array([0]), np.zeros(2, int), Batching(2, packing=False),
                            epochs=1, seed=0)  # fmt: skip
    packed = client_batches(tok, np.array([1]), np.zeros(2, int), Batching(2), epochs=1, seed=0)
    with pytest.raises(ValueError, match="mix padded and packed"):
        stack_clients([padded, packed])
    with pytest.raises(ValueError, match="does not fit attention rows"):
        client_batches(tok, np.array([1]), np.zeros(2, int), Batching(2, row_width=2), epochs=1,
                       seed=0)  # fmt: skip


@pytest.mark.parametrize("packing", [False, True])
def test_eval_batches_once_each_padded_sorted_by_length_packed_in_order(packing):
    tok, clients, labels, lengths = _setup()
    for ix in clients:
        steps = client_eval_batches(tok, ix, labels, Batching(4, packing=packing))
        rows = _rows(steps)
        assert np.array_equal(np.sort(rows), np.sort(ix))
        if packing:  # in the client's order: full packed batches all about B mean lengths
            np.testing.assert_array_equal(rows, ix)
        else:  # no shuffle: ascending length, so similar lengths share a batch
            _check_padded(steps, tok, labels, lengths)
            assert np.all(np.diff(lengths[rows]) >= 0)


def test_eval_batches_ignore_the_training_only_settings():
    tok, clients, labels, _ = _setup()
    for packing in (False, True):
        base = client_eval_batches(tok, clients[0], labels, Batching(4, packing=packing))
        other = client_eval_batches(tok, clients[0], labels, Batching(
            4, packing=packing, bucketing=True, window=2, shuffle=False))  # fmt: skip
        assert len(base) == len(other)
        for a, b in zip(base, other, strict=True):
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("batch_size", [8, 32, 64])
def test_clients_smaller_than_one_batch(batch_size):
    tok, clients, labels, lengths = _setup(sizes=(7, 3, 1))
    for ix in clients:
        steps = client_batches(tok, ix, labels, Batching(batch_size, packing=False), epochs=2,
                               seed=0)  # fmt: skip
        _check_padded(steps, tok, labels, lengths)
        assert len(steps) == 2
        assert np.array_equal(np.sort(_rows(steps)), np.sort(np.tile(ix, 2)))


def test_padding_waste_by_hand():
    tok = _tokenized([3, 8, 5])
    steps = client_batches(tok, np.array([0, 1, 2]), np.zeros(3, int),
                           Batching(2, shuffle=False, packing=False), epochs=1, seed=0)
    # step 1: B=2 x T=8 = 16 positions, 3 + 8 real; step 2: 2 x 8 = 16 positions, 5 real
    assert padding_waste(steps) == pytest.approx(1 - 16 / 32, abs=0)
    # stacked with a masked step for a second client that has one example of 4 tokens
    one = client_batches(tok, np.array([2]), np.zeros(3, int), Batching(2, packing=False),
                         epochs=1, seed=0)  # fmt: skip
    stacked = stack_clients([steps, one])
    # 2 steps x 2 clients x 2 rows x 8 = 64 computed; real 3 + 8 + 5 + 5 = 21
    assert padding_waste(stacked) == pytest.approx(1 - 21 / 64, abs=0)
    # a masked step (client 2's second) is skipped when clients run one at a time
    assert padding_waste(stacked, skip_masked_steps=True) == pytest.approx(1 - 21 / 48, abs=0)


@pytest.mark.slow
def test_packed_padding_waste_under_10_percent_on_real_rotten_tomatoes():
    from fedjax_split.data.partition import partition_clients
    from fedjax_split.data.sources import load_examples
    from fedjax_split.data.tokenization import load_tokenizer, tokenize

    ex = load_examples("rotten_tomatoes")
    tok = tokenize(load_tokenizer("minilm-l6"), ex.texts_a, max_length=128)
    assert 20 < tok.lengths.mean() < 35  # about 27 word pieces with [CLS]/[SEP]
    part = partition_clients(ex.labels, scheme="iid", num_clients=10, seed=0)
    for batch in (8, 16, 32):
        steps = [s for i, c in enumerate(part.clients) for s in client_batches(
            tok, c.train, ex.labels, Batching(batch), epochs=1, seed=0, client_id=i)]  # fmt: skip
        assert padding_waste(steps) < 0.10, (batch, padding_waste(steps))
        padded = [s for c in part.clients[:2] for s in client_batches(tok, c.train, ex.labels,
                  Batching(batch, packing=False), epochs=1, seed=0)]  # fmt: skip
        assert padding_waste(padded) > 0.3


# ----------------------------------------------------------------------------- packing


def _sentence_pool(n: int, seed: int = 0):
    """Sentence-like lengths (median ~25, long tail to 90), pair-free, with [CLS]=1 first."""
    from fedjax_split.data.tokenization import Tokenized

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(3.2, 0.45, n)), 3, 90).astype(np.int64)
    ids = [np.concatenate([[1], rng.integers(5, 999, k - 1)]).astype(np.int32) for k in lengths]
    types = [(np.arange(k) >= k // 2).astype(np.int32) for k in lengths]
    return Tokenized(ids, types, lengths.astype(np.int32)), ids, types


def test_packed_steps_hold_every_example_once_intact() -> None:
    tok, ids, types = _sentence_pool(300)
    clients = [np.arange(0, 90), np.arange(90, 140), np.arange(140, 300)]
    labels = np.arange(300) % 3
    width = default_row_width(tok)
    assert width == 96  # the pool's longest example (90) rounded up to 8, over the 64 floor
    seen = []  # (client, pool index) of every real example
    for cid, ix in enumerate(clients):
        steps = client_batches(tok, ix, labels, Batching(8), epochs=2, seed=5, client_id=cid)
        assert len(steps) == 2 * math.ceil(ix.size / 8)
        for step in steps:
            assert step.packed and step.attention_mask.shape[-1] == width
            assert step.cls_index.shape == (1, 8)
            seen += [(cid, e) for e in _packed_examples(step, ids, types, labels)]
    # two epochs: every client's example exactly twice
    counts = Counter(seen)
    assert set(counts.values()) == {2}
    assert {ix for _, ix in counts} == set(range(300))
    assert all(ix in clients[c] for c, ix in counts)


def _packed_examples(step, ids, types, labels) -> list[int]:
    """Checks that every real example of a packed step lies intact in its stream and in one
    attention row; returns the pool index of each."""
    seen = []
    w = step.attention_mask.shape[-1]
    for j in range(step.input_ids.shape[0]):
        slots = step.attention_mask[j].reshape(-1)
        rows, back = step.row_tokens[j].reshape(-1), step.token_slots[j]
        used = np.nonzero(slots)[0]
        np.testing.assert_array_equal(back[rows[used]], used)  # slots <-> stream
        for e in np.nonzero(step.example_mask[j])[0]:
            ix = step.example_index[j, e]
            start, m = step.cls_index[j, e], len(ids[ix])
            stream = slice(start, start + m)
            assert start + m <= step.input_ids.shape[-1]
            np.testing.assert_array_equal(step.input_ids[j, stream], ids[ix])
            np.testing.assert_array_equal(step.token_type_ids[j, stream], types[ix])
            np.testing.assert_array_equal(step.position_ids[j, stream], np.arange(m))
            # one example's tokens share a row and carry its slot number
            where = back[stream]
            assert len(set(where // w)) == 1
            assert np.all(slots[where] == e + 1)
            assert step.labels[j, e] == labels[ix]
            seen.append(int(ix))
    return seen


@pytest.mark.parametrize("packing", [False, True])
def test_token_labels_follow_their_tokens(packing: bool) -> None:
    """A token task's labels travel with the tokens: padded [S, B, T] or packed [S, N] streams,
    IGNORE on every padding position (also where stacking grows a client); the per-example
    labels are not used."""
    lengths = [3, 9, 5, 7, 4]
    tok = _tokenized(lengths)
    # example j's token t has label 100 * j + t: distinct, so any misplacement shows
    tok.labels = [100 * j + np.arange(n, dtype=np.int32) for j, n in enumerate(lengths)]
    clients = [np.array([0, 1, 2]), np.array([3, 4])]
    how = Batching(2, objective=TOKEN_CLASSIFICATION, packing=packing, row_width=16)
    per_client = [client_batches(tok, ix, np.zeros(5, int), how, epochs=1, seed=3, client_id=c)
                  for c, ix in enumerate(clients)]  # fmt: skip
    seen = {}
    for step in stack_clients(per_client):
        labels, ids = step.labels, step.input_ids
        assert labels.shape == ids.shape and labels.dtype == np.int32
        real = labels != IGNORE
        np.testing.assert_array_equal(
            ids[real] - 1, (labels[real] % 100) + 7 * (labels[real] // 100)
        )
        for value in labels[real]:
            seen[int(value)] = seen.get(int(value), 0) + 1
    assert seen == {100 * j + t: 1 for j, n in enumerate(lengths) for t in range(n)}
    with pytest.raises(ValueError, match="per-token labels"):
        client_batches(tok, clients[0], np.zeros(5, int), Batching(2), epochs=1, seed=0)


def test_row_width_for_max_length_holds_any_truncated_example() -> None:
    from fedjax_split.data.batching import row_width_for

    assert row_width_for(16) == 64  # never narrower than the packed default
    assert row_width_for(128) == 128 and row_width_for(129) == 136  # multiples of 8
    for n in (1, 64, 65, 200):
        assert row_width_for(n) >= n
