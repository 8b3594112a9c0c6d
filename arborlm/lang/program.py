"""`ProgramFunction` (what `@function` makes): running programs, alone or in batches.

`run(*args, **kwargs)` calls the function body in the caller's thread with a fresh
`ProgramState` (its expressions execute on the state's worker) and returns the state; an
exception raised by the body propagates to the caller. `run(stream=True)` runs the body on a
thread of its own and returns at once, for `text_iter()`. `run_batch(list_of_kwargs)` runs the
programs on a thread pool — concurrently, so the runtime batches them — after prefilling the
program's constant prefix once (found by tracing, see `tracer.py`); an exception in one
program is kept in its state (`s.error()`, and re-raised as `ProgramError` when a variable it
did not produce is read) rather than stopping the batch.

Sampling keyword arguments of `run` / `run_batch` are the program's defaults for every `gen`
that leaves them unset. The default backend is module state set by `set_default_backend`, also
readable as SGLang's `global_config.default_backend`.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from arborlm.lang.interpreter import StreamExecutor
from arborlm.lang.ir import GenParams
from arborlm.lang.state import ProgramState

logger = logging.getLogger(__name__)

_default_backend: Any = None
_default_backend_as_given: Any = None

# Shorter constant prefixes are not worth a separate prefill request.
PRECACHE_MIN_CHARS = 64


def set_default_backend(backend: Any) -> None:
    """The backend programs use when `run` gets none: a backend, an `arborlm.Engine`, or an
    object whose `endpoint` is a backend (the shape of SGLang's `Runtime`)."""
    global _default_backend, _default_backend_as_given
    _default_backend = as_backend(backend)
    _default_backend_as_given = backend


def get_default_backend() -> Any:
    return _default_backend


class GlobalConfig:
    """SGLang's `sgl.global_config`, for programs that read their backend from it:
    `default_backend` is what `set_default_backend` was given (assigning it sets it). SGLang's
    other settings there are not ArborLM's and are not provided."""

    __slots__ = ()

    @property
    def default_backend(self) -> Any:
        return _default_backend_as_given

    @default_backend.setter
    def default_backend(self, backend: Any) -> None:
        set_default_backend(backend)


global_config = GlobalConfig()


def as_backend(backend: Any) -> Any:
    """Backends stay as they are; an `arborlm.Engine` is wrapped in an `EngineBackend`; an
    object whose `endpoint` is a backend (SGLang's `Runtime`) stands for that backend."""
    from arborlm.lang.backends.base import BaseBackend

    if backend is None or isinstance(backend, BaseBackend):
        return backend
    if isinstance(getattr(backend, "endpoint", None), BaseBackend):
        return backend.endpoint
    if hasattr(backend, "generate") and hasattr(backend, "tokenizer"):
        from arborlm.lang.backends.engine_backend import EngineBackend

        return EngineBackend(backend)
    raise TypeError(f"not a backend: {backend!r}")


def resolve_backend(backend: Any) -> Any:
    backend = as_backend(backend) if backend is not None else _default_backend
    if backend is None:
        raise ValueError("no backend: call arborlm.set_default_backend(...) or pass backend=")
    return backend


class ProgramFunction:
    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None):
        self.func = func
        names = list(inspect.signature(func).parameters)
        if not names:
            raise TypeError(f"program {func.__name__} must take the state as its first argument")
        self.arg_names = names[1:]
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> ProgramFunction:
        """A copy with some arguments fixed (they also count as constant when tracing)."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__} has no argument(s) {', '.join(unknown)}")
        return ProgramFunction(self.func, {**self.bind_arguments, **kwargs})

    def run(self, *args: Any, max_new_tokens: int = 128, stop: str | list[str] | None = None,
            stop_token_ids: list[int] | None = None, stop_regex: str | list[str] | None = None,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            ignore_eos: bool = False, return_logprob: bool | None = None,
            logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
            return_text_in_logprobs: bool | None = None, stream: bool = False,
            backend: Any = None, **kwargs: Any) -> ProgramState:
        defaults = GenParams.program_defaults(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
            stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program(self, resolve_backend(backend), args, kwargs, defaults, stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, max_new_tokens: int = 128,
                  stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                  stop_regex: str | list[str] | None = None, temperature: float = 1.0,
                  top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                  frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                  ignore_eos: bool = False, return_logprob: bool | None = None,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None, backend: Any = None,
                  num_threads: int | str = "auto",
                  progress_bar: bool = False) -> list[ProgramState]:
        defaults = GenParams.program_defaults(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids,
            stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs)
        return run_program_batch(self, resolve_backend(backend), batch_kwargs, defaults,
                                 num_threads, progress_bar)

    def constant_prefix(self, backend: Any = None) -> str:
        """The text every run of this program starts with (found by tracing)."""
        from arborlm.lang.tracer import extract_prefix_by_tracing

        return extract_prefix_by_tracing(self.func, self.arg_names, self.bind_arguments,
                                         resolve_backend(backend))

    def cache(self, backend: Any = None) -> str:
        """Prefill the program's constant prefix in the backend's cache; returns it."""
        backend = resolve_backend(backend)
        prefix = self.constant_prefix(backend)
        if len(prefix) >= PRECACHE_MIN_CHARS:
            backend.cache_prefix(prefix)
        return prefix

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def _call_body(program: ProgramFunction, state: ProgramState, args: tuple,
               kwargs: dict[str, Any], raise_errors: bool) -> None:
    executor = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **{**program.bind_arguments, **kwargs})
    except Exception as e:
        if raise_errors:
            raise
        logger.warning("program %s raised %r", program.__name__, e)
        executor.record_error(e)
    finally:
        executor.end()


def run_program(program: ProgramFunction, backend: Any, args: tuple, kwargs: dict[str, Any],
                defaults: GenParams, stream: bool = False, in_batch: bool = False) -> ProgramState:
    """Run one program; `stream` returns before the body has run (on its own thread).

    `in_batch`: keep an exception of the body in the state instead of raising it, and wait
    for the state's worker before returning.
    """
    executor = StreamExecutor(backend, kwargs, defaults, stream=stream)
    state = ProgramState(executor)
    if stream:
        threading.Thread(target=_call_body, args=(program, state, args, kwargs, False),
                         name=f"arborlm-stream-{program.__name__}", daemon=True).start()
        return state
    _call_body(program, state, args, kwargs, raise_errors=not in_batch)
    if in_batch:
        executor.sync()
    return state


def run_program_batch(program: ProgramFunction, backend: Any,
                      batch_kwargs: list[dict[str, Any]], defaults: GenParams,
                      num_threads: int | str, progress_bar: bool) -> list[ProgramState]:
    if len(batch_kwargs) > 1:
        program.cache(backend)
    if num_threads == "auto":
        num_threads = max(96, multiprocessing.cpu_count() * 16)
    num_threads = max(1, min(int(num_threads), len(batch_kwargs)))
    bar = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(batch_kwargs), desc=program.__name__)

    def one(kwargs: dict[str, Any]) -> ProgramState:
        state = run_program(program, backend, (), dict(kwargs), defaults, in_batch=True)
        if bar is not None:
            bar.update()
        return state

    try:
        with ThreadPoolExecutor(num_threads, thread_name_prefix="arborlm-batch") as pool:
            return list(pool.map(one, batch_kwargs))
    finally:
        if bar is not None:
            bar.close()
