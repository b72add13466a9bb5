"""Data: every task's example pool, tokenised, partitioned over clients and batched.

The shared pieces sit here: `sources` (the front door that loads any labelled task's pool into
`examples.Examples`, from GLUE's files or the hub, `glue`, or an offline corpus,
`offline_corpora`), `tokenization`, `partition` (the paper's tables, `paper_tables`, and
Dirichlet skews, `label_skew`), the typed batches (`batch`) and per-client batching (`batching`:
the pool's tokens flattened, `flat_tokens`; packed parts, `packing`; clients stacked for vmap,
`stacking`). Pipeline-specific code sits in subpackages: `tokens` (token classification: NER
corpora) and `text` (unlabelled text for masked-LM pre-training); neither imports the other.
"""
