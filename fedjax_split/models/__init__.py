"""Models: the Flax BERT encoder and its heads, Hugging Face import/export, FLOP counts."""
