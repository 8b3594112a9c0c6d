"""Runs SGLang's own frontend test programs (`sglang/test/test_programs.py`) against ArborLM.

    python -m tests.lang.sglang_programs MODE TARGET '[["test_select", {...}], ...]'

(the programs to run, each with its keyword arguments). MODE `sglang`: SGLang's frontend,
unchanged, through its own `RuntimeEndpoint(TARGET)` (an ArborLM server's URL). `arborlm`: the
same functions with `sglang` meaning `arborlm` (the module's `sgl`, and `import sglang as sgl`
inside a function, give `arborlm`), through ArborLM's `RuntimeEndpoint(TARGET)`;
`arborlm-engine`: the same on an in-process `EngineBackend` of the model at TARGET (float32).
Each program runs on
its own thread with a time limit; one JSON line per program goes to stdout:
`{"name": ..., "outcome": "passed" | "failed", "detail": <traceback tail>}`.

The scaffolding, not the programs, is adapted in three places:
- `test_gen_min_new_tokens` reads `global_config.default_backend.endpoint`: the default backend
  is then a `Runtime`-shaped holder of the endpoint (what SGLang's `sgl.Runtime` is); and its
  `get_tokenizer` import (`sglang.srt.utils.hf_transformers_utils`, which needs torchvision,
  a server dependency) is served by `transformers.AutoTokenizer`.
- `join(mode="concate_and_append")` (`test_parallel_encoding`) makes SGLang's `RuntimeEndpoint`
  post to `/concate_and_append_request`, which SGLang 0.5's own server no longer has either: in
  `sglang` mode `global_config.enable_parallel_encoding` is off, so it appends the text.
- Programs take the keyword arguments the caller gives (`check_answer=False`: the answer
  checks need a trained model).

And `test_stream_logprobs` through SGLang's frontend is tried up to `RACY_ATTEMPTS` times: that
frontend keeps only the latest chunk's meta_info (`StreamExecutor._execute_gen` assigns
`meta_info[name]` per chunk), so when two chunks arrive while `text_async_iter`'s reader is
between two wake-ups, one chunk's logprob entries are lost and the program's own check fails —
about one run in three on the tiny model, whose tokens come about 1 ms apart; SGLang's server
would meet the same race. On a busy machine the reader wakes late so often that every attempt
could meet it, so that program's stream is also paced (`read_one_chunk_at_a_time`: a chunk is
handed over once the reader has woken for the previous one). The outcome's detail says how many
attempts it took. (The server's
side of it is checked exactly by `test_native_stream_follows_sglang_logprob_semantics`, and
ArborLM's frontend adds the chunks up, so it has no such race.)
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
import types
from typing import Any

PROGRAM_TIMEOUT_S = 180.0
RACY = {("sglang", "test_stream_logprobs")}
RACY_ATTEMPTS = 10
# Longest a racy program's stream waits for SGLang's reader to take the previous chunk.
HANDSHAKE_WAIT_S = 30.0


def _runtime_holder(backend: Any) -> Any:
    """An object shaped like SGLang's `Runtime`: the backend is its `endpoint`."""
    return types.SimpleNamespace(endpoint=backend)


def _tokenizer_helper() -> types.ModuleType:
    from transformers import AutoTokenizer

    module = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    module.get_tokenizer = lambda path, **kw: AutoTokenizer.from_pretrained(path)  # type: ignore[attr-defined]
    return module


def prepare(mode: str, target: str) -> tuple[Any, Any, dict[str, Any]]:
    """(the test_programs module, the backend, per-program default backends)."""
    import sglang
    from sglang.test import test_programs

    sys.modules["sglang.srt.utils.hf_transformers_utils"] = _tokenizer_helper()
    if mode == "sglang":
        backend = sglang.RuntimeEndpoint(target)
        sglang.global_config.enable_parallel_encoding = False
        sgl: Any = sglang
    else:
        import arborlm

        if mode == "arborlm-engine":
            backend = arborlm.EngineBackend(model_path=target, dtype="float32")
        else:
            backend = arborlm.RuntimeEndpoint(target)
        test_programs.sgl = arborlm
        sys.modules["sglang"] = arborlm  # `import sglang as sgl` inside a function
        sgl = arborlm
    sgl.set_default_backend(backend)
    special = {"test_gen_min_new_tokens": _runtime_holder(backend)}
    return test_programs, sgl, special


def run_one(module: Any, sgl: Any, name: str, kwargs: dict[str, Any],
            default_backend: Any, attempts: int = 1) -> dict[str, Any]:
    result: dict[str, Any] = {"name": name, "outcome": "failed",
                              "detail": f"timed out after {PROGRAM_TIMEOUT_S:.0f} s"}

    def body() -> None:
        for attempt in range(1, attempts + 1):
            try:
                getattr(module, name)(**kwargs)
                result.update(outcome="passed", detail=f"attempt {attempt} of {attempts}")
                return
            except BaseException:  # noqa: BLE001 - reported to the test
                result["detail"] = (f"attempt {attempt} of {attempts}: "
                                    + traceback.format_exc()[-3000:])

    sgl.set_default_backend(default_backend)
    thread = threading.Thread(target=body, name=f"sglang-program-{name}", daemon=True)
    thread.start()
    thread.join(PROGRAM_TIMEOUT_S)
    return result


def read_one_chunk_at_a_time(backend: Any) -> None:
    """Make `backend.generate_stream` (SGLang's `RuntimeEndpoint`) hand over its next chunk only
    once the program's reader has woken for the previous one (its stream event cleared). On a
    busy machine the reader wakes late, often enough that all attempts above met the race; this
    paces SGLang's client, not the server, whose chunks are checked exactly elsewhere."""
    stream = backend.generate_stream

    def paced(s: Any, *args: Any, **kwargs: Any) -> Any:
        for chunk in stream(s, *args, **kwargs):
            events = list((s.stream_var_event or {}).values())
            deadline = time.monotonic() + HANDSHAKE_WAIT_S
            while any(e.is_set() for e in events) and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(0.002)  # the reader cleared its event: let it read what it woke for
            yield chunk

    backend.generate_stream = paced


def main(argv: list[str]) -> None:
    mode, target, programs = argv[0], argv[1], json.loads(argv[2])
    module, sgl, special = prepare(mode, target)
    backend = sgl.global_config.default_backend
    for name, kwargs in programs:
        attempts = RACY_ATTEMPTS if (mode, name) in RACY else 1
        target = special.get(name, backend)
        plain = target.__dict__.get("generate_stream")
        if (mode, name) in RACY:
            read_one_chunk_at_a_time(target)
        result = run_one(module, sgl, name, kwargs, target, attempts)
        if (mode, name) in RACY:  # the other programs stream as SGLang does
            if plain is None:
                del target.generate_stream
            else:
                target.generate_stream = plain
        print(json.dumps(result), flush=True)
    if hasattr(backend, "shutdown"):  # ArborLM's backends; SGLang's RuntimeEndpoint has none
        backend.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
