"""sources: local GLUE TSV/parquet layouts end to end, hub (monkeypatched), offline, cache."""

import collections
import sys
import types
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedjax_split.data import examples, sources
from fedjax_split.data.sources import load_examples, tokenize_examples
from fedjax_split.errors import UserError


def _tsv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows), encoding="utf-8")


def _parquet(path, columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


MNLI_HEAD = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
             "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
             "sentence2", "label1", "gold_label"]  # fmt: skip


def _mnli_row(i, premise, hypothesis, label):
    return [i, 0, f"{i}e", "fiction", "(x)", "(y)", "(X)", "(Y)", premise, hypothesis, label, label]


@pytest.fixture
def glue_tsv(tmp_path):
    root = tmp_path / "glue"
    _tsv(root / "SST-2/train.tsv", [["sentence", "label"], ["a fine film", 1], ['dull "quoted', 0]])
    _tsv(root / "SST-2/dev.tsv", [["sentence", "label"], ["great", 1]])
    _tsv(root / "CoLA/train.tsv", [["gj04", 1, "", "The cat sat."], ["gj04", 0, "*", "Cat the."]])
    _tsv(root / "CoLA/dev.tsv", [["gj04", 1, "", "It rains."]])
    _tsv(root / "MNLI/train.tsv", [MNLI_HEAD, _mnli_row(0, "p0", "h0", "neutral")])
    _tsv(root / "MNLI/dev_matched.tsv", [MNLI_HEAD, _mnli_row(1, "p1", "h1", "entailment")])
    _tsv(root / "MNLI/dev_mismatched.tsv",
         [MNLI_HEAD, _mnli_row(2, "p2", "h2", "contradiction"),
          _mnli_row(3, "p3", "h3", "entailment")])  # fmt: skip
    sts_head = ["index", "genre", "filename", "year", "old_index", "source1", "source2",
                "sentence1", "sentence2", "score"]  # fmt: skip
    _tsv(
        root / "STS-B/train.tsv",
        [sts_head, [0, "g", "f", "y", 0, "s", "s", "A man.", "A guy.", 4.2]],
    )
    _tsv(root / "STS-B/dev.tsv", [sts_head, [1, "g", "f", "y", 1, "s", "s", "Dogs.", "Cats.", 0.5]])
    _tsv(root / "QNLI/train.tsv", [["index", "question", "sentence", "label"],
                                   [0, "Who?", "Him.", "entailment"]])  # fmt: skip
    _tsv(root / "QNLI/dev.tsv", [["index", "question", "sentence", "label"],
                                 [1, "Where?", "Nowhere said.", "not_entailment"]])  # fmt: skip
    mrpc_head = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    _tsv(root / "MRPC/train.tsv", [mrpc_head, [1, 11, 12, "He said.", "He stated."]])
    _tsv(root / "MRPC/dev.tsv", [mrpc_head, [0, 13, 14, "Up.", "Down."]])
    return root


def test_tsv_single_sentence_tasks(glue_tsv):
    ex = load_examples("sst2", data_dir=glue_tsv)
    assert ex.texts_a == ["a fine film", 'dull "quoted', "great"] and ex.texts_b is None
    assert ex.labels.tolist() == [1, 0, 1] and ex.labels.dtype == np.int64
    assert ex.splits.tolist() == ["train", "train", "validation"] and ex.groups is None
    cola = load_examples("cola", data_dir=glue_tsv / "CoLA")  # the task folder itself
    assert cola.texts_a == ["The cat sat.", "Cat the.", "It rains."]
    assert cola.labels.tolist() == [1, 0, 1]


def test_tsv_pair_tasks_string_labels_and_stsb(glue_tsv):
    q = load_examples("qnli", data_dir=glue_tsv)
    assert q.texts_a == ["Who?", "Where?"] and q.texts_b == ["Him.", "Nowhere said."]
    assert q.labels.tolist() == [0, 1]
    m = load_examples("mrpc", data_dir=glue_tsv, source="local")
    assert m.texts_b == ["He stated.", "Down."] and m.labels.tolist() == [1, 0]
    s = load_examples("stsb", data_dir=glue_tsv)
    assert s.labels.dtype == np.float32 and s.labels.tolist() == pytest.approx([4.2, 0.5])
    assert s.texts_a == ["A man.", "Dogs."]


def test_tsv_mnli_matched_mismatched_groups(glue_tsv):
    ex = load_examples("mnli", data_dir=glue_tsv)
    assert ex.texts_a == ["p0", "p1", "p2", "p3"] and ex.texts_b == ["h0", "h1", "h2", "h3"]
    assert ex.labels.tolist() == [1, 0, 2, 0]
    assert ex.groups.tolist() == ["matched", "matched", "mismatched", "mismatched"]
    assert ex.splits.tolist() == ["train", "validation_matched"] + ["validation_mismatched"] * 2


def test_parquet_layout(tmp_path):
    root = tmp_path / "hub"
    _parquet(root / "sst2/train-00000-of-00001.parquet",
             {"sentence": ["good", "bad"], "label": [1, 0], "idx": [0, 1]})  # fmt: skip
    _parquet(root / "sst2/validation-00000-of-00001.parquet",
             {"sentence": ["ok"], "label": [1], "idx": [0]})  # fmt: skip
    _parquet(root / "sst2/test-00000-of-00001.parquet",
             {"sentence": ["unlabelled"], "label": [-1], "idx": [0]})  # fmt: skip
    ex = load_examples("sst2", data_dir=root)
    assert ex.texts_a == ["good", "bad", "ok"] and ex.labels.tolist() == [1, 0, 1]
    for split, n in (("train", 2), ("validation_matched", 1), ("validation_mismatched", 2)):
        shards = 2 if split == "train" else 1
        for part in range(shards):
            _parquet(root / f"mnli/{split}-0000{part}-of-0000{shards}.parquet",
                     {"premise": [f"{split}{part}p{i}" for i in range(n)],
                      "hypothesis": [f"h{i}" for i in range(n)],
                      "label": [i % 3 for i in range(n)], "idx": list(range(n))})  # fmt: skip
    m = load_examples("mnli", data_dir=root / "mnli")
    assert len(m) == 2 * 2 + 1 + 2
    assert m.texts_a[:4] == ["train0p0", "train0p1", "train1p0", "train1p1"]
    assert collections.Counter(m.groups.tolist()) == {"matched": 5, "mismatched": 2}
    _parquet(root / "stsb/train-00000-of-00001.parquet",
             {"sentence1": ["a"], "sentence2": ["b"], "label": [3.25], "idx": [0]})  # fmt: skip
    _parquet(root / "stsb/validation-00000-of-00001.parquet",
             {"sentence1": ["c"], "sentence2": ["d"], "label": [1.0], "idx": [0]})  # fmt: skip
    s = load_examples("stsb", data_dir=root)
    assert s.labels.tolist() == [3.25, 1.0] and s.texts_b == ["b", "d"]


def test_invalid_rows_name_task_and_rows(tmp_path):
    _tsv(tmp_path / "SST-2/train.tsv",
         [["sentence", "label"], ["ok", 1], ["", 0], ["fine", 2], ["x", ""], ["y", 1]])  # fmt: skip
    _tsv(tmp_path / "SST-2/dev.tsv", [["sentence", "label"], ["z", "positive"]])
    with pytest.raises(UserError) as e:
        load_examples("sst2", data_dir=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("task sst2: 3 invalid rows")
    assert "train.tsv:3 (empty sentence)" in msg and "train.tsv:4 (label '2')" in msg
    assert "train.tsv:5 (label '')" in msg
    _tsv(tmp_path / "RTE/train.tsv", [["index", "sentence1", "sentence2", "label"], [0, "a"]])
    _tsv(tmp_path / "RTE/dev.tsv", [["index", "sentence1", "sentence2", "label"]])
    with pytest.raises(UserError, match=r"task rte: 1 rows with missing columns .* train.tsv:2"):
        load_examples("rte", data_dir=tmp_path)


def test_missing_local_data_messages(tmp_path):
    with pytest.raises(UserError, match="no GLUE files found") as e:
        load_examples("qqp", data_dir=tmp_path)
    assert "DIR/QQP/train.tsv, dev.tsv" in str(e.value) and "DIR/qqp/train-*.parquet" in str(
        e.value
    )
    with pytest.raises(UserError, match="not a directory"):
        load_examples("qqp", data_dir=tmp_path / "nope")
    _tsv(tmp_path / "MNLI/train.tsv", [MNLI_HEAD, _mnli_row(0, "p", "h", "neutral")])
    with pytest.raises(UserError, match="no dev_matched.tsv or validation_matched"):
        load_examples("mnli", data_dir=tmp_path)
    _tsv(tmp_path / "QQP/train.tsv", [["id", "question1", "is_duplicate"], [0, "q", 1]])
    with pytest.raises(UserError, match=r"lacks columns \['question2'\]"):
        load_examples("qqp", data_dir=tmp_path)
    with pytest.raises(UserError, match="unknown data source"):
        load_examples("sst2", source="s3")
    with pytest.raises(UserError, match="needs --data-dir"):
        load_examples("sst2", source="local")
    with pytest.raises(UserError, match="no offline copy"):
        load_examples("sst2", source="offline")
    with pytest.raises(UserError, match="not on the hub"):
        load_examples("trec", source="hub")


def _fake_datasets(monkeypatch, fn):
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fn))


def test_hub_source_via_monkeypatch(monkeypatch):
    calls = []

    def load_dataset(path, name):
        calls.append((path, name))
        return {
            "train": {"question1": ["a?", "b?"], "question2": ["c?", "d?"], "label": [0, 1]},
            "validation": {"question1": ["e?"], "question2": ["f?"], "label": [1]},
            "test": {"question1": ["g?"], "question2": ["h?"], "label": [-1]},
        }

    _fake_datasets(monkeypatch, load_dataset)
    ex = load_examples("qqp")  # auto -> hub for a GLUE task without data_dir
    assert calls == [("nyu-mll/glue", "qqp")]
    assert ex.texts_a == ["a?", "b?", "e?"] and ex.texts_b == ["c?", "d?", "f?"]
    assert ex.labels.tolist() == [0, 1, 1]


def test_hub_source_with_real_datasets_objects(monkeypatch):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"premise": ["p0"], "hypothesis": ["h0"], "label": [2], "idx": [0]}
            ),
            "validation_matched": datasets.Dataset.from_dict(
                {"premise": ["p1"], "hypothesis": ["h1"], "label": [0], "idx": [0]}
            ),
            "validation_mismatched": datasets.Dataset.from_dict(
                {"premise": ["p2"], "hypothesis": ["h2"], "label": [1], "idx": [0]}
            ),
        }
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name: dd)
    ex = load_examples("mnli", source="hub")
    assert ex.texts_a == ["p0", "p1", "p2"] and ex.labels.tolist() == [2, 0, 1]
    assert ex.groups.tolist() == ["matched", "matched", "mismatched"]


def test_hub_unreachable_is_one_line_user_error(monkeypatch):
    def load_dataset(path, name):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub\n(offline)")

    _fake_datasets(monkeypatch, load_dataset)
    with pytest.raises(UserError) as e:
        load_examples("rte", source="auto")
    msg = str(e.value)
    assert "\n" not in msg and "could not load nyu-mll/glue/rte from the Hugging Face hub" in msg
    assert "--data-dir DIR" in msg and "DIR/RTE/train.tsv" in msg


def test_offline_corpus_from_a_local_dir(tmp_path):
    lines = ["Category\tText", "d\tstring", "class\t", ""]
    _tsv(tmp_path / "x/20newsgroups-train.tab", [])
    (tmp_path / "x/20newsgroups-train.tab").write_text(
        "\n".join([*lines, "sci.med\tdoctor said", "alt.atheism\tno god"]) + "\n"
    )
    (tmp_path / "x/20newsgroups-test.tab").write_text(
        "\n".join([*lines, "talk.religion.misc\tfaith"]) + "\n"
    )
    ex = load_examples("20news", data_dir=tmp_path)
    assert ex.texts_a == ["doctor said", "no god", "faith"]
    assert ex.labels.tolist() == [13, 0, 19] and ex.splits.tolist() == ["train", "train", "test"]
    (tmp_path / "x/20newsgroups-test.tab").write_text("\n".join([*lines, "sci.med"]) + "\n")
    with pytest.raises(UserError, match=r"20newsgroups-test.tab:5 \(label None\)"):
        load_examples("20news", data_dir=tmp_path)
    with pytest.raises(UserError, match="question_labels.txt not found"):
        load_examples("trec", data_dir=tmp_path)
    # damaged copies: one line naming the file, never a traceback
    (tmp_path / "x/20newsgroups-test.tab").write_bytes(b"Category\tText\nsci.med\t\xff\xfe\n")
    with pytest.raises(UserError, match=r"task 20news: cannot read .*20newsgroups-test.tab"):
        load_examples("20news", data_dir=tmp_path)
    (tmp_path / "y").mkdir()
    (tmp_path / "y/rotten_tomatoes_corpus_full.csv.bz2").write_bytes(b"not bz2")
    with pytest.raises(UserError, match=r"cannot read .*rotten_tomatoes_corpus_full.csv.bz2 \("):
        load_examples("rotten_tomatoes", data_dir=tmp_path / "y")


@pytest.mark.slow
def test_offline_corpora_row_counts_through_assets_fetch():
    rt = load_examples("rotten_tomatoes")  # auto -> offline
    assert len(rt) == 7403 + 5405 and rt.texts_b is None
    assert np.bincount(rt.labels).tolist() == [5405, 7403]  # rotten = 0, fresh = 1
    news = load_examples("20news", source="offline")
    assert collections.Counter(news.splits.tolist()) == {"train": 11293, "test": 7528}
    assert np.unique(news.labels).size == 20
    trec = load_examples("trec")
    # TREC train_5500 coarse counts: ABBR, ENTY, DESC, HUM, LOC, NUM
    assert np.bincount(trec.labels).tolist() == [86, 1250, 1162, 1223, 835, 896]
    assert trec.texts_a[0] == "How did serfdom develop in and then leave Russia ?"


class _CountingTokenizer:
    """A stand-in fast tokenizer: ids are word lengths; counts its calls."""

    name_or_path = "fake-tok"

    def __init__(self, vocab_tag="v1"):
        self.calls = 0
        self.backend_tokenizer = types.SimpleNamespace(to_str=lambda: f"fake {vocab_tag}")

    def __call__(self, a, b=None, *, truncation, max_length, padding, return_attention_mask,
                 return_token_type_ids):  # fmt: skip
        self.calls += 1
        ids, tts = [], []
        for i, t in enumerate(a):
            x = [101, *(len(w) + 1000 for w in t.split()), 102]
            tt = [0] * len(x)
            if b is not None:
                y = [len(w) + 1000 for w in b[i].split()] + [102]
                x, tt = x + y, tt + [1] * len(y)
            ids.append(x[:max_length])
            tts.append(tt[:max_length])
        return {"input_ids": ids, "token_type_ids": tts}


def test_tokenize_cache_hit_skips_the_tokenizer(tmp_path, glue_tsv):
    ex = load_examples("mrpc", data_dir=glue_tsv)
    tok = _CountingTokenizer()
    first = tokenize_examples(ex, tok, "mrpc", max_length=16, cache_dir=tmp_path)
    calls = tok.calls
    assert calls >= 1 and len(list(tmp_path.glob("*.npz"))) == 1
    second = tokenize_examples(ex, tok, "mrpc", max_length=16, cache_dir=tmp_path)
    assert tok.calls == calls  # served from the cache
    for x, y in zip(first.input_ids + first.token_type_ids,
                    second.input_ids + second.token_type_ids, strict=True):  # fmt: skip
        np.testing.assert_array_equal(x, y)
        assert y.dtype == np.int32
    np.testing.assert_array_equal(first.lengths, second.lengths)
    assert second.input_ids[0].tolist() == [101, 1002, 1005, 102, 1002, 1007, 102]
    assert second.token_type_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    # other max_length, other tokenizer vocabulary, other data: misses
    tokenize_examples(ex, tok, "mrpc", max_length=5, cache_dir=tmp_path)
    other = _CountingTokenizer("v2")
    tokenize_examples(ex, other, "mrpc", max_length=16, cache_dir=tmp_path)
    changed = sources.Examples(ex.texts_a, ["x", "y"], ex.labels)
    tokenize_examples(changed, tok, "mrpc", max_length=16, cache_dir=tmp_path)
    assert tok.calls == calls * 3 and other.calls == calls
    assert len(list(tmp_path.glob("*.npz"))) == 4 and not list(tmp_path.glob("*.tmp"))


def test_corrupt_cache_file_is_rewritten(tmp_path, glue_tsv):
    ex = load_examples("sst2", data_dir=glue_tsv)
    tok = _CountingTokenizer()
    tokenize_examples(ex, tok, "sst2", max_length=8, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(b"garbage")
    again = tokenize_examples(ex, tok, "sst2", max_length=8, cache_dir=tmp_path)
    assert tok.calls == 2 and again.lengths.tolist() == [5, 4, 3]
    tokenize_examples(ex, tok, "sst2", max_length=8, cache_dir=tmp_path)
    assert tok.calls == 2


@pytest.mark.slow
def test_tokenize_cache_with_the_real_tokenizer(tmp_path, monkeypatch):
    from fedjax_split.data import tokenization

    ex = load_examples("trec")
    small = examples.Examples(ex.texts_a[:50], None, ex.labels[:50])
    tok = tokenization.load_tokenizer("minilm-l6")
    first = tokenize_examples(small, tok, "trec", max_length=32, cache_dir=tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("tokenised again although cached")

    monkeypatch.setattr(sources, "tokenize", fail)  # where tokenize_examples looks it up
    with pytest.raises(AssertionError, match="tokenised again"):  # the patch bites on a miss
        tokenize_examples(small, tok, "trec", max_length=32, cache_dir=tmp_path / "empty")
    second = tokenize_examples(small, tok, "trec", max_length=32, cache_dir=tmp_path)
    assert [x.tolist() for x in first.input_ids] == [x.tolist() for x in second.input_ids]
    assert (
        second.input_ids[0][0] == tok.cls_token_id and second.input_ids[0][-1] == tok.sep_token_id
    )


def test_a_sites_train_file_alone_and_with_its_dev_file(tmp_path):
    _tsv(tmp_path / "a/train.tsv", [["sentence", "label"], ["good", 1], ["bad", 0]])
    ex = sources.load_site("sst2", tmp_path / "a")  # no dev.tsv: a site may have none
    assert ex.texts_a == ["good", "bad"] and ex.labels.tolist() == [1, 0]
    assert ex.splits.tolist() == ["train", "train"]
    _tsv(tmp_path / "a/dev.tsv", [["sentence", "label"], ["fine", "positive"]])
    assert sources.load_site("sst2", tmp_path / "a").splits.tolist() == [
        "train", "train", "validation"]  # fmt: skip
    # the hub's parquet layout, in the task's sub-folder, and MNLI's groups
    _parquet(tmp_path / "b/sst2/train-00000.parquet",
             {"sentence": ["ok"], "label": [1], "idx": [0]})  # fmt: skip
    assert sources.load_site("sst2", tmp_path / "b").labels.tolist() == [1]
    _tsv(tmp_path / "c/train.tsv", [MNLI_HEAD, _mnli_row(0, "p0", "h0", "neutral")])
    _tsv(tmp_path / "c/dev_mismatched.tsv", [MNLI_HEAD, _mnli_row(1, "p1", "h1", "entailment")])
    mnli = sources.load_site("mnli", tmp_path / "c")
    assert mnli.groups.tolist() == ["matched", "mismatched"] and mnli.labels.tolist() == [1, 0]


def test_a_sites_unknown_label_or_missing_train_file_is_one_line_naming_the_file(tmp_path):
    _tsv(tmp_path / "a/train.tsv", [["sentence", "label"], ["good", 1], ["meh", "neutral"]])
    with pytest.raises(UserError) as e:
        sources.load_site("sst2", tmp_path / "a")
    assert "train.tsv:3 (label 'neutral')" in str(e.value) and "\n" not in str(e.value)
    assert "one of ['negative', 'positive']" in str(e.value)  # the task's labels, not the data's
    _tsv(tmp_path / "b/dev.tsv", [["sentence", "label"], ["good", 1]])
    with pytest.raises(UserError, match="no GLUE files found in .*b; a site's directory holds"):
        sources.load_site("sst2", tmp_path / "b")
    with pytest.raises(UserError, match="does not exist"):
        sources.load_site("sst2", tmp_path / "nope")
    with pytest.raises(UserError, match="task ner with --site-data: pass --entity-types"):
        sources.load_site("ner", tmp_path / "a")


def test_a_ner_sites_conll_files_in_the_runs_vocabulary(tmp_path):
    """A token task's site: its CoNLL train file trains, its dev and test files test, every
    tag in the run's vocabulary (a type the site lacks still has its tags)."""
    from fedjax_split.data.tokens.conll import write_conll

    write_conll(tmp_path / "train.txt", [(["Ann", "left"], ["B-per", "O"]), (["hi"], ["O"])])
    write_conll(tmp_path / "dev.txt", [(["Bo"], ["B-per"])])
    write_conll(tmp_path / "test.txt", [(["ok"], ["O"])])
    ex = sources.load_site("ner", tmp_path, entity_types=("per", "org"))
    assert ex.splits.tolist() == ["train", "train", "dev", "test"]
    assert ex.tag_names == ("O", "B-org", "I-org", "B-per", "I-per")
    assert ex.tokens[0] == ["Ann", "left"] and ex.labels.tolist() == [1, 2, 1, 2]
    # the fingerprint a checkpoint records: the same files give the same one, one tag changed
    # (the same words, so the same sentences) another
    again = sources.load_site("ner", tmp_path, entity_types=("per", "org"))
    assert again.fingerprint() == ex.fingerprint()
    write_conll(tmp_path / "dev.txt", [(["Bo"], ["B-org"])])
    assert sources.load_site("ner", tmp_path, entity_types=("per", "org")).fingerprint() != (
        ex.fingerprint())  # fmt: skip
    write_conll(tmp_path / "test.txt", [(["ok"], ["O"]), (["IBM"], ["B-org"]), (["x"], ["I-loc"])])
    with pytest.raises(UserError, match=r"test.txt:5: tag 'I-loc' is not in the tag vocabulary"):
        sources.load_site("ner", tmp_path, entity_types=("per", "org"))


def test_a_site_of_an_offline_corpus_keeps_its_files_splits(tmp_path):
    """20news's own train and test files: its rows say which file they came from (a site's
    test split is its test file's rows, `partition.site_split`)."""
    lines = ["Category\tText", "d\tstring", "class\t", ""]
    (tmp_path / "20newsgroups-train.tab").write_text(
        "\n".join([*lines, "sci.med\tdoctor said", "alt.atheism\tno god"]) + "\n")  # fmt: skip
    (tmp_path / "20newsgroups-test.tab").write_text(
        "\n".join([*lines, "talk.religion.misc\tfaith"]) + "\n")  # fmt: skip
    ex = sources.load_site("20news", tmp_path)
    assert ex.splits.tolist() == ["train", "train", "test"] and ex.labels.tolist() == [13, 0, 19]


def test_a_sites_damaged_files_are_one_line_with_the_sites_layout(tmp_path):
    """A site's files cross a trust boundary: bytes that are not UTF-8, a truncated or foreign
    parquet file, a file where the directory should be are each one line that names the file and
    gives the site's layout (never --data-dir, which a site run refuses)."""
    good = b"sentence\tlabel\ngood\t1\nbad\t0\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "a/train.tsv").write_bytes(good + b"the movie \xff\xfe good\t1\n")
    _parquet(tmp_path / "b/train-00000.parquet", {"sentence": ["ok"] * 50, "label": [1] * 50})
    data = (tmp_path / "b/train-00000.parquet").read_bytes()
    (tmp_path / "b/train-00000.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "c").mkdir()
    (tmp_path / "c/train-00000.parquet").write_bytes(b"not a parquet file")
    (tmp_path / "d").write_text("a file\n")
    cases = [("a", r"a/train.tsv is not UTF-8 text \(line 4: byte b'\\xff'\); save it as UTF-8"),
             ("b", r"b/train-00000.parquet is not a readable parquet file \("),
             ("c", r"c/train-00000.parquet is not a readable parquet file \("),
             ("d", r"d' is a file, not a directory")]  # fmt: skip
    for site, message in cases:
        with pytest.raises(UserError, match=message) as e:
            sources.load_site("sst2", tmp_path / site)
        assert "\n" not in str(e.value) and "--data-dir" not in str(e.value), str(e.value)
    # a missing column, at a site: the site's layout, not --data-dir's, and none of the file's
    # content (its error reaches the server; a header-less file's first line is an example)
    _tsv(tmp_path / "e/train.tsv", [["a private review", 1], ["good", 1]])
    with pytest.raises(UserError, match="lacks columns.*first line has 2 fields.*a site's") as e:
        sources.load_site("sst2", tmp_path / "e")
    assert "--data-dir" not in str(e.value) and "private" not in str(e.value)
    # a label column holding text (misaligned fields): only its first characters are quoted
    _tsv(tmp_path / "f/train.tsv", [["sentence", "label"], ["ok", "my long private review text"]])
    with pytest.raises(UserError, match=r"train.tsv:2 \(label 'my long private revi\.\.\.'\)"):
        sources.load_site("sst2", tmp_path / "f")


def test_a_byte_order_mark_and_a_document_long_field_are_read(tmp_path):
    """Files saved by spreadsheet programs start with a UTF-8 byte-order mark, and a text may be a
    whole document (over csv's default 131,072-character field limit): both are ordinary data."""
    long_text = "good " * 30000
    (tmp_path / "a").mkdir()
    (tmp_path / "a/train.tsv").write_bytes(
        "\ufeffsentence\tlabel\nfine\t1\n".encode() + f"{long_text}\t0\n".encode()
    )
    ex = sources.load_site("sst2", tmp_path / "a")
    assert ex.texts_a == ["fine", long_text] and ex.labels.tolist() == [1, 0]


def test_a_site_too_small_for_a_test_split_is_warned_of(tmp_path):
    """Two training rows and no dev file: a fifth of them rounds to none, so the site trains but
    is never scored; it is said, not left to be noticed in the mean over clients."""
    from fedjax_split.run import client_data
    from fedjax_split.run.config import ExperimentConfig

    _tsv(tmp_path / "a/train.tsv", [["sentence", "label"], ["good", 1], ["bad", 0]])
    config = ExperimentConfig.of(task="sst2", site_data=str(tmp_path / "a"))
    examples = sources.load_site("sst2", tmp_path / "a")
    with pytest.warns(UserWarning, match=r"site 0 .* has no test examples \(2 training rows"):
        split = client_data.site_split(config, examples, 0, tmp_path / "a")
    assert split.train.size == 2 and split.test.size == 0
    _tsv(tmp_path / "a/dev.tsv", [["sentence", "label"], ["fine", 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with its dev file: no warning
        client_data.site_split(config, sources.load_site("sst2", tmp_path / "a"), 0, tmp_path)


def test_iob1_tags_are_warned_of(tmp_path):
    """CoNLL-2003's original files are IOB1 (an entity may start with I-): accepted, but strict
    IOB2 scoring counts no entity there, so it is said."""
    from fedjax_split.data.tokens.conll import write_conll
    from fedjax_split.tasks import bio

    assert bio.stray_inside(["I-per", "I-per", "O", "B-org", "I-org", "I-per"]) == 2
    assert bio.stray_inside(["B-per", "I-per", "O"]) == 0
    write_conll(tmp_path / "train.txt", [(["Ann", "left"], ["I-per", "O"]), (["hi"], ["O"])])
    with pytest.warns(UserWarning, match=r"1 sentences have an entity that starts with I- \(IOB1"):
        sources.load_site("ner", tmp_path, entity_types=("per",))


def test_a_tagged_fingerprint_covers_the_tag_vocabulary(tmp_path):
    """The same sentences in a larger vocabulary: the words, tags and partition labels agree, but
    the tokenised labels are other ids, so a cache or checkpoint keyed on the fingerprint must
    tell them apart."""
    from fedjax_split.data.tokens.conll import write_conll

    write_conll(tmp_path / "train.txt", [(["Ann"], ["B-per"]), (["Bo", "x"], ["B-per", "O"])])
    one = sources.load_site("ner", tmp_path, entity_types=("per",))
    two = sources.load_site("ner", tmp_path, entity_types=("per", "zzz"))
    assert one.labels.tolist() == two.labels.tolist() and one.tags == two.tags
    assert one.tag_names != two.tag_names and one.fingerprint() != two.fingerprint()
