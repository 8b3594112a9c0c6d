"""Prefix cache behind a small interface: a radix tree over token ids, and a no-op cache."""
