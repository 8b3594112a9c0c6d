"""Grammar-constrained decoding (not built yet; see issue "Grammar-constrained decoding").

Will hold the grammar backends (xgrammar, outlines-core) behind one interface, the bounded
compile cache and thread pool, and the packed int32 token bitmasks applied before sampling.
"""
