"""Data: tasks and their objectives, sources (hub, local files, offline assets), tokenisation,
client partitions and batching."""
