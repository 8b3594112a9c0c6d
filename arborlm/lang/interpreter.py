"""`StreamExecutor`: runs one program state's expressions in order on its own worker thread.

The program's Python code (the `@function` body) runs in the caller's thread and only
*submits* expressions (`s += ...`); the executor's worker executes them one by one, calling the
backend for `gen` / `select`. So `s += gen("a")` returns at once, independent programs and
forked branches wait on the backend concurrently (and the runtime batches them), and the
program blocks only when it reads a result (`s["a"]`, `s.text()`, `s.fork()`).

Failure model: the first exception stops the worker, is kept as `error_`, and releases every
waiter. Afterwards reading a variable the program never produced raises `ProgramError` (its
`__cause__` is the original exception), submitting more raises it too, and a stream iterator
ends by raising it: a failed program never leaves its caller waiting.

Variables are counted per name (submitted vs done), so a name reused in a loop is read only
once its latest submission has finished. `use_thread=False` executes synchronously in the
caller's thread (the tracer uses it).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import Counter
from typing import Any

from arborlm.lang import stream_meta
from arborlm.lang.chat_template import ChatTemplate
from arborlm.lang.errors import ProgramError
from arborlm.lang.ir import (
    ConcatAndAppend,
    ConstantText,
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    WarmPrefix,
    as_expr,
    variable_names,
)

logger = logging.getLogger(__name__)

_END = object()


class StreamExecutor:
    def __init__(self, backend: Any, arguments: dict[str, Any], default_params: GenParams,
                 chat_template: ChatTemplate | None = None, stream: bool = False,
                 use_thread: bool = True):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_params = default_params
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        self.error_: BaseException | None = None
        self.is_finished = False
        self._stream_text: dict[str, str] = {}
        self._scope_starts: dict[str, int] = {}
        self._submitted: Counter[str] = Counter()
        self._done: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._pending = 0
        self._accepting = True
        self.use_thread = use_thread
        if use_thread:
            self._queue: queue.Queue = queue.Queue()
            self._worker = threading.Thread(target=self._work, daemon=True,
                                            name=f"arborlm-program-{self.sid[:8]}")
            self._worker.start()

    # --- caller side ----------------------------------------------------------------------------

    def submit(self, expr: Any) -> None:
        expr = as_expr(expr)
        with self._cond:
            if self.error_ is not None:
                raise ProgramError(f"the program already failed: {self.error_!r}") \
                    from self.error_
            if not self._accepting:
                raise RuntimeError("this program state has ended (joined or finished); "
                                   "it takes no more expressions")
            for name in variable_names(expr):
                self._submitted[name] += 1
            if self.use_thread:
                self._pending += 1
                self._queue.put(expr)
                return
        self._execute(expr)

    def sync(self) -> None:
        """Wait until every submitted expression has run (or the program failed)."""
        if self.use_thread:
            with self._cond:
                self._cond.wait_for(lambda: self._pending == 0 or self.is_finished)

    def end(self) -> None:
        """No more expressions: the worker exits once the queue is empty."""
        with self._cond:
            if not self._accepting:
                return
            self._accepting = False
            if self.use_thread:
                self._queue.put(_END)
            else:
                self.is_finished = True

    def record_error(self, error: BaseException) -> None:
        """Fail the program from outside the worker (an exception in the program's code)."""
        with self._cond:
            if self.error_ is None:
                self.error_ = error
            self._cond.notify_all()

    def get_var(self, name: str) -> Any:
        self._wait_var(name)
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(f"variable {name!r} was not produced: the program failed with "
                               f"{self.error_!r}") from self.error_
        raise KeyError(name)

    def set_var(self, name: str, value: Any) -> None:
        with self._cond:
            self.variables[name] = value

    def get_meta_info(self, name: str, timeout: float | None = None) -> Any:
        if not self._wait_var(name, timeout):
            raise TimeoutError(f"timed out waiting for variable {name!r}")
        return self.meta_info.get(name)

    def _var_ready(self, name: str) -> bool:
        return (self._done[name] >= self._submitted[name] or self.error_ is not None
                or self.is_finished)

    def _wait_var(self, name: str, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._var_ready(name), timeout)

    def fork(self, size: int) -> list[StreamExecutor]:
        """`size` executors continuing from this state's text, messages and variables."""
        size = int(size)
        if size > 1:
            self.submit(WarmPrefix())
        self.sync()
        if self.error_ is not None:
            raise ProgramError(f"cannot fork a failed program: {self.error_!r}") from self.error_
        children = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.arguments, self.default_params,
                                   self.chat_template, self.stream)
            child.text_ = self.text_
            child.messages_ = [dict(m) for m in self.messages_]
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
            children.append(child)
        return children

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.messages_

    def error(self) -> BaseException | None:
        self.sync()
        return self.error_

    def wait_text(self, prev: int) -> tuple[str, bool]:
        """(text after position `prev`, whether the program has finished), once either holds."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.text_) > prev or self.is_finished)
            return self.text_[prev:], self.is_finished

    def wait_var_text(self, name: str, prev: int,
                      sent: dict[str, int]) -> tuple[str, Any, bool]:
        """Streaming variable `name`: (its text after `prev`, its meta_info with the output
        logprob entries after `sent` — advanced when there is new text, see `stream_meta.since`
        —, whether it is complete)."""

        def ready() -> bool:
            return len(self._stream_text.get(name, "")) > prev or self._var_complete(name)

        with self._cond:
            self._cond.wait_for(ready)
            piece = self._stream_text.get(name, "")[prev:]
            meta = self.meta_info.get(name)
            if piece and isinstance(meta, dict):
                meta = stream_meta.since(meta, sent)
            return piece, meta, self._var_complete(name)

    def _var_complete(self, name: str) -> bool:
        return (self.is_finished or self.error_ is not None
                or 0 < self._submitted[name] <= self._done[name])

    # --- worker ---------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                break
            try:
                self._execute(expr)
            except Exception as e:  # noqa: BLE001 - kept for the caller
                logger.warning("program %s failed: %r", self.sid[:8], e)
                self._fail(e)
                break
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()
        with self._cond:
            self.is_finished = True
            self._accepting = False
            self._cond.notify_all()
        self.backend.end_program(self)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self.error_ = error
            self._accepting = False
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._pending = 0
            self._cond.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            self._done[name] += 1
            self._cond.notify_all()

    def _fill(self, text: str) -> None:
        with self._cond:
            self.text_ += text
            self._cond.notify_all()

    def _execute(self, expr: Expr) -> None:
        handler = _HANDLERS.get(type(expr))
        if handler is None:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")
        handler(self, expr)

    def _execute_list(self, expr: ExprList) -> None:
        for item in expr.items:
            self._execute(item)

    def _execute_text(self, expr: ConstantText) -> None:
        self._fill(str(expr.value))

    def _execute_gen(self, expr: Gen) -> None:
        params = self.resolve_params(expr.params)
        if self.stream:
            text, meta = self._stream_gen(expr.name, params)
        else:
            text, meta = self.backend.generate(self, params)
            self._fill(text)
        self._set_var(expr.name, convert_dtype(expr.name, params.dtype, text), meta)

    def _stream_gen(self, name: str | None, params: GenParams) -> tuple[str, Any]:
        text: str = ""
        meta: dict[str, Any] | None = None
        for delta, chunk in self.backend.generate_stream(self, params):
            text += delta
            with self._cond:
                meta = stream_meta.accumulate(meta, chunk or {})
                self.text_ += delta
                if name is not None:
                    self._stream_text[name] = text
                    self.meta_info[name] = meta
                self._cond.notify_all()
        return text, meta

    def resolve_params(self, params: GenParams) -> GenParams:
        """The gen's params over the program's defaults, plus the chat template's stop strings."""
        merged = params.merged_over(self.default_params)
        stop = merged.stop_list()
        stop += [s for s in self.chat_template.stop_str if s not in stop]
        merged.stop = stop or None
        return merged

    def _execute_select(self, expr: Select) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._fill(decision.decision)
        self._set_var(expr.name, decision.decision, decision.meta_info)

    def _execute_role_begin(self, expr: RoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"roles do not nest: {expr.role!r} begins inside {self.cur_role!r}")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and expr.role != "system" and default_system:
            self._execute_role_begin(RoleBegin("system"))
            self._fill(default_system)
            self._execute_role_end(RoleEnd("system"))
        prefix, _ = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._fill(prefix)
        self.cur_role = expr.role
        self.cur_role_begin_pos = len(self.text_)

    def _execute_role_end(self, expr: RoleEnd) -> None:
        if self.cur_role != expr.role:
            raise ValueError(f"role {expr.role!r} ends but {self.cur_role!r} is open")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._fill(suffix)
        with self._cond:
            self.messages_.append({"role": expr.role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None

    def _execute_scope_begin(self, expr: VarScopeBegin) -> None:
        self._scope_starts[expr.name] = len(self.text_)

    def _execute_scope_end(self, expr: VarScopeEnd) -> None:
        start = self._scope_starts.pop(expr.name)
        self._set_var(expr.name, self.text_[start:], None)

    def _execute_warm(self, expr: WarmPrefix) -> None:
        if self.text_:
            self.backend.cache_prefix(self.text_)

    def _execute_concat(self, expr: ConcatAndAppend) -> None:
        for state in expr.states:
            child = state.stream_executor
            child.sync()
            self._fill(child.text_[child.fork_start_text_pos:])


_HANDLERS = {
    ExprList: StreamExecutor._execute_list,
    ConstantText: StreamExecutor._execute_text,
    Gen: StreamExecutor._execute_gen,
    Select: StreamExecutor._execute_select,
    RoleBegin: StreamExecutor._execute_role_begin,
    RoleEnd: StreamExecutor._execute_role_end,
    VarScopeBegin: StreamExecutor._execute_scope_begin,
    VarScopeEnd: StreamExecutor._execute_scope_end,
    WarmPrefix: StreamExecutor._execute_warm,
    ConcatAndAppend: StreamExecutor._execute_concat,
}


def convert_dtype(name: str | None, dtype: str | None, text: str) -> Any:
    """A typed gen's value: int / float / bool parsed from its text, str without its quotes."""
    if dtype is None:
        return text
    stripped = text.strip()
    if dtype == "str":
        if len(stripped) >= 2 and stripped[0] == stripped[-1] == '"':
            return stripped[1:-1]
        return stripped
    try:
        if dtype == "int":
            return int(stripped)
        if dtype == "float":
            return float(stripped)
    except ValueError:
        raise ValueError(f"gen {name!r} with dtype {dtype} produced {text!r}, which is not "
                         f"a{'n' if dtype == 'int' else ''} {dtype} (max_tokens too small?)"
                         ) from None
    if stripped not in ("True", "False"):
        raise ValueError(f"gen {name!r} with dtype bool produced {text!r}, not True / False")
    return stripped == "True"
