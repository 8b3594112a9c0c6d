"""A ReAct-style agent loop: the model thinks, picks an action with `select`, and the program
calls a Python tool and feeds the observation back, until it picks "finish".

    python examples/react_agent.py [--url URL]
"""

from __future__ import annotations

import ast
import operator

from example_backend import backend_from_args

import arborlm as sgl

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The tool: evaluate + - * / arithmetic (nothing else) and report errors as text."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is allowed")
    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


@sgl.function
def agent(s, task, max_steps=3):
    s += sgl.system("Solve the task. Use the calculator for arithmetic. "
                    "Format: Thought / Action (calculator or finish) / Action Input.")
    s += sgl.user(task)
    for _ in range(max_steps):
        s += "Thought:" + sgl.gen("thought", max_tokens=16, stop="\n") + "\n"
        s += "Action:" + sgl.select("action", choices=[" calculator", " finish"]) + "\n"
        s += "Action Input:" + sgl.gen("action_input", max_tokens=12, stop="\n") + "\n"
        if s["action"] == " finish":
            return s["action_input"].strip()
        s += f"Observation: {calculator(s['action_input'])}\n"
    return None


def main(argv: list[str] | None = None) -> sgl.ProgramState:
    with backend_from_args(__doc__.splitlines()[0], argv) as backend:
        state = agent.run("What is (12 + 30) * 3?", backend=backend, temperature=0)
        print(state.text())
        print("calculator check: (12 + 30) * 3 =", calculator("(12 + 30) * 3"))
        print("answer:", state.ret_value)
        return state


# What this printed on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, bfloat16 on
# an AVX512-BF16 CPU), in-process:
# Thought:
# Action: finish
# Action Input: 12 + 30 = 32
#
# calculator check: (12 + 30) * 3 = 126
# answer: 12 + 30 = 32
# (a 135M model skips the calculator and answers wrongly; the loop, the tool and `select` run.)


if __name__ == "__main__":
    main()
