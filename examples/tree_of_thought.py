"""Tree of thought with nested `fork`: several plans, several steps per plan, all branches
running concurrently on one shared (cached) prefix; then the model picks the best plan.

    python examples/tree_of_thought.py [--url URL]
"""

from __future__ import annotations

from example_backend import backend_from_args

import arborlm as sgl

NUM_PLANS, NUM_STEPS = 2, 2


@sgl.function
def tree_of_thought(s, question):
    s += sgl.user(question)
    with s.assistant():
        s += "Let me consider a few plans.\n"
        plans = s.fork(NUM_PLANS)
        for i, plan in enumerate(plans):
            plan += f"Plan {i + 1}: Practice" + sgl.gen("plan", max_tokens=16, stop="\n") + "\n"
            steps = plan.fork(NUM_STEPS)
            steps += lambda j: f"Step {j + 1}: I will" + sgl.gen("step", max_tokens=16, stop="\n")
            steps.join()
        plans.join()
        for i, plan in enumerate(s["plan"]):
            s += f"Plan {i + 1}:{plan}\n"
        s += "The best plan is Plan" + sgl.select(
            "best", choices=[f" {i + 1}" for i in range(NUM_PLANS)])


def main(argv: list[str] | None = None) -> sgl.ProgramState:
    with backend_from_args(__doc__.splitlines()[0], argv) as backend:
        state = tree_of_thought.run("How can I learn to play the piano in a year?",
                                    backend=backend, temperature=0.7)
        for i, (plan, steps) in enumerate(zip(state["plan"], state["step"])):
            print(f"plan {i + 1}: {plan!r}")
            for j, step in enumerate(steps):
                print(f"    step {j + 1}: {step!r}")
        print("best plan:", state["best"].strip())
        return state


# What this printed on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, bfloat16 on
# an AVX512-BF16 CPU), in-process:
# plan 1: ' regularly.'
#     step 1: ' provide you with a code and you can take a few minutes to practice.'
#     step 2: ' help you practice in a way that works for you, so you can make the'
# plan 2: ' regularly.'
#     step 1: ' practice daily.'
#     step 2: ' provide you with a test.'
# best plan: 1


if __name__ == "__main__":
    main()
