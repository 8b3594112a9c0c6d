"""Finding a program's constant prefix by tracing, so `run_batch` can prefill it once.

The program body runs once, synchronously, against a tracing backend, with every unbound
argument replaced by a placeholder. Constant text and chat roles build the prompt as usual;
tracing stops at the first thing whose value is not known in advance — a `gen`, a `select`, a
`fork`, a variable read, or any use of an argument (turning it into text, iterating it, ...).
The text built until then is the prefix every run shares. Any other exception the body raises
while tracing also just ends the trace.

This is not a general program analysis: code that branches on something other than its
arguments is traced along whatever path it takes on this one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from arborlm.lang.backends.base import BaseBackend
from arborlm.lang.choices import ChoicesDecision
from arborlm.lang.interpreter import StreamExecutor
from arborlm.lang.ir import ConstantText, ExprList, GenParams
from arborlm.lang.state import ProgramState


class StopTracing(Exception):
    """Raised where the program's text stops being constant."""


class ArgumentPlaceholder:
    """Stands for an argument while tracing: any attempt to use its value ends the trace,
    except `"text" + arg`, which keeps the constant text before the argument."""

    def __init__(self, name: str):
        self.name = name

    def _stop(self, *args: Any, **kwargs: Any) -> Any:
        raise StopTracing(f"argument {self.name!r} is used")

    __str__ = __format__ = __iter__ = __len__ = __getitem__ = __bool__ = __int__ = _stop
    __float__ = __index__ = __eq__ = __hash__ = __call__ = __contains__ = _stop

    def __add__(self, other: Any) -> ExprList:
        return ExprList([ConstantText(self), ConstantText(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([ConstantText(other), ConstantText(self)])


class TracingBackend(BaseBackend):
    """A backend whose every model call ends the trace; it knows only the chat template."""

    def __init__(self, backend: BaseBackend):
        self.chat_template = backend.get_chat_template()
        self.is_chat_model = backend.is_chat_model

    def generate(self, s: StreamExecutor, params: GenParams) -> tuple[str, dict[str, Any]]:
        raise StopTracing("gen")

    def generate_stream(self, s: StreamExecutor,
                        params: GenParams) -> Iterator[tuple[str, dict[str, Any]]]:
        raise StopTracing("gen")

    def select(self, s: StreamExecutor, choices: list[str], temperature: float,
               choices_method: Any) -> ChoicesDecision:
        raise StopTracing("select")

    def cache_prefix(self, prefix: str) -> None:
        raise StopTracing("fork")


def extract_prefix_by_tracing(func: Callable[..., Any], arg_names: Sequence[str],
                              bound: Mapping[str, Any], backend: BaseBackend) -> str:
    """The constant text at the start of every run of the program body `func` on `backend`.

    `func(state, **arguments)` is a program's body, `arg_names` its arguments after the state,
    and `bound` those fixed in advance (they count as constants; the rest become placeholders).
    """
    tracer = TracingBackend(backend)
    executor = StreamExecutor(tracer, {}, GenParams.program_defaults(), use_thread=False)
    state = ProgramState(executor)
    arguments = {name: bound.get(name, ArgumentPlaceholder(name)) for name in arg_names}
    try:
        func(state, **arguments)
    except Exception:  # noqa: BLE001 - StopTracing, or the body failing on a placeholder
        pass
    return executor.text_
