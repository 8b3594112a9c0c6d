"""ArborLM's HTTP server: SGLang's native API and an OpenAI-compatible API over one engine.

- `cli`: `arborlm serve` / `python -m arborlm.server` (flags from `ServerArgs` + `EngineArgs`);
  `uvicorn_server` runs the app (ready line, drained SIGTERM exits 0).
- `app.create_app(client, server_args, engine_args)`: the FastAPI app; `native` (/generate and
  the control routes) and `openai_api` (/v1/...) are its routers; `protocol` /
  `openai_protocol` the pydantic request models; `generation` runs requests on the engine
  (admission gate, metrics, client-disconnect aborts); `sse`, `chat`, `tokens`,
  `openai_format`, `metrics`, `limits`, `middleware`, `errors` the pieces around them.

The server talks to the engine only through an `EngineClient`; in the default multi-process
mode this process holds the tokenizer and the FastAPI app, never model code. Importing this
package imports neither FastAPI nor the engine.
"""
