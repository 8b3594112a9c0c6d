"""Sampling: logits processing (penalties, bias, masks), token choice, logprobs."""
