"""Data: every task's example pool, tokenised, partitioned over clients and batched.

The shared pieces sit here: `sources` (the front door that loads any labelled task's pool from
the hub, local files or an offline asset), `tokenization`, `partition`, and the typed batches
(`batch`) and per-client batching (`batching`). Pipeline-specific code sits in subpackages:
`tokens` (token classification: NER corpora) and `text` (unlabelled text for masked-LM
pre-training); neither imports the other.
"""
