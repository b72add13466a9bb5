"""Running experiments: the config schema, the experiment loop, checkpoints and output files."""
