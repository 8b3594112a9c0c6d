"""Tensor parallelism: the ranks' process group, weight shards, and rank 0's batch broadcast."""
