"""GGUF checkpoints (llama.cpp's one-file format): config, weights and tokenizer from one file.

`files` finds and opens the file, `metadata` turns its keys into a Hugging Face config dict,
`tensors` streams its weights dequantized under Hugging Face names (`dequant` decodes the
block formats), `tokenizer` rebuilds its tokenizer and chat template.
"""
