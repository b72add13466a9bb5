"""Token classification (NER) data: BIO-tagged sentences from CoNLL files (`conll`) or from the
offline corpora (`ner_corpora`: WNUT-16, and NERO with its BIO tags derived), loaded as a task's
pool with its tag vocabulary and partition labels and tokenised with word-aligned labels
(`tagged`). `data.sources` hands a token task's loading here."""
