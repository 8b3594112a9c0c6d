"""`ProgramState` (the `s` a program receives) and `ProgramStateGroup` (what `s.fork(n)` returns).

A thin user-facing layer over a `StreamExecutor`: `s += expr` submits, `s["name"]` waits for
and returns a variable, `s.text()` / `s.messages()` wait for everything submitted so far.
`with s.user(): ...` wraps the appended expressions in a chat role. Streaming runs expose
`text_iter()` / `text_async_iter()`, which yield new text as it is generated and raise
`ProgramError` at the end if the program failed; with `return_meta_data`, each piece of a
variable comes with its meta_info as SGLang streams it (the output logprob lists hold the
entries since the previous piece, `stream_meta.py`).

`forks.join()` gathers each variable the branches created into a list on the parent, in branch
order; `join("concate_and_append")` instead appends every branch's new text to the parent.
`forks += expr` appends to every branch and `forks[i] += expr` to one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from arborlm.lang.errors import ProgramError
from arborlm.lang.interpreter import StreamExecutor
from arborlm.lang.ir import (
    ConcatAndAppend,
    Expr,
    ExprList,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
)


class ProgramState:
    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # --- building -------------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program state")
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            role_expr = ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])
            self.stream_executor.submit(role_expr)
            return role_expr

        @contextmanager
        def scope() -> Iterator[None]:
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Any = None) -> Any:
        """With an argument: append a system message now; without: `with s.system(): ...`."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """`with s.var_scope("x"): ...` stores the text appended inside as variable `x`."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` branches continuing from here, each running on its own worker."""
        executors = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(e) for e in executors], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """`with s.copy() as t: ...`: one branch, joined (variables gathered) on exit."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # --- reading --------------------------------------------------------------------------------

    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The exception that stopped the program, or None (waits for submitted work)."""
        return self.stream_executor.error()

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The backend's meta_info for variable `name` (finish reason, token counts,
        cached_tokens, logprobs; for select: the scores the decision was made from)."""
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    # --- streaming ------------------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """New text as it is generated (the whole program's, or one variable's)."""
        for piece, _ in self._iter(var_name):
            yield piece

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`text_iter` for asyncio code; with `return_meta_data`, (text, meta_info) pairs.

        A piece's meta_info is the variable's so far, except that its output logprob lists
        (`output_token_logprobs`, ...) hold only the entries since the previous piece, as in
        SGLang; `output_token_logprobs_length` and `completion_tokens` count all so far.
        """
        loop = asyncio.get_running_loop()
        it = self._iter(var_name)
        done = object()
        while True:
            item = await loop.run_in_executor(None, next, it, done)
            if item is done:
                return
            yield item if return_meta_data else item[0]

    def _iter(self, var_name: str | None) -> Iterator[tuple[str, Any]]:
        exe = self.stream_executor
        if not exe.stream:
            yield (self.text() if var_name is None else self.get_var(var_name),
                   None if var_name is None else exe.meta_info.get(var_name))
            return
        prev = 0
        sent: dict[str, int] = {}
        while True:
            meta = None
            if var_name is None:
                piece, done = exe.wait_text(prev)
            else:
                piece, meta, done = exe.wait_var_text(var_name, prev, sent)
            prev += len(piece)
            if piece:
                yield piece, meta
            if done:
                break
        if exe.error_ is not None:
            raise ProgramError(f"the program failed: {exe.error_!r}") from exe.error_

    def __del__(self) -> None:
        executor = getattr(self, "stream_executor", None)
        if executor is not None:
            executor.end()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    def __init__(self, states: list[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch and bring its results back to the parent state."""
        try:
            if mode == "gather_variable":
                self._gather()
            elif mode == "concate_and_append":
                self.src_state += ConcatAndAppend(self.states)
                self.src_state.sync()
            else:
                raise ValueError(f"join mode must be gather_variable or concate_and_append, "
                                 f"got {mode!r}")
        finally:
            for state in self.states:
                state.stream_executor.end()

    def _gather(self) -> None:
        parent = self.src_state.stream_executor
        before = set(parent.variables)
        for state in self.states:
            child = state.stream_executor
            child.sync()
            if child.error_ is not None:
                raise ProgramError(f"a forked branch failed: {child.error_!r}") from child.error_
        for state in self.states:
            child = state.stream_executor
            for name in sorted(set(child.variables) - before):
                parent.set_var(name, [*parent.variables.get(name, []), child.variables[name]])

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        """`forks[i] += expr` appends to branch `i` and then stores the branch back in its
        place (Python's `x[i] += y`); storing a different state there is an error."""
        if value is not self.states[i]:
            raise TypeError("a fork group's branches cannot be replaced; append to branch i "
                            "with forks[i] += ...")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Expr | str | list | tuple | Callable[[int], Any],
                 ) -> ProgramStateGroup:
        """Append to every branch: one expression for all, a list (one per branch), or a
        function of the branch index."""
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, item in zip(self.states, other):
                state += item
        elif callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        else:
            for state in self.states:
                state += other
        return self
