"""The HTTP server (not built yet; see issue "HTTP server").

Will hold the FastAPI app with the SGLang-compatible native API and the OpenAI-compatible API,
request validation at the edge, Prometheus metrics, and the `arborlm serve` launcher.
"""
