"""Streaming: `run(stream=True)` returns at once; `text_iter()` yields text as it is generated
(`text_async_iter()` is the asyncio version).

    python examples/streaming.py [--url URL]
"""

from __future__ import annotations

import asyncio

from example_backend import backend_from_args

import arborlm as sgl


@sgl.function
def story(s, topic):
    s += sgl.user(f"Tell a short story about {topic}.")
    s += sgl.assistant(sgl.gen("story", max_tokens=32))


def main(argv: list[str] | None = None) -> list[str]:
    with backend_from_args(__doc__.splitlines()[0], argv) as backend:
        state = story.run("a lighthouse", backend=backend, stream=True, temperature=0)
        pieces = []
        for piece in state.text_iter("story"):
            pieces.append(piece)
            print(piece, end="", flush=True)
        print(f"\n[{len(pieces)} pieces]")

        async def stream_async() -> None:
            s = story.run("a robot", backend=backend, stream=True)
            async for piece in s.text_async_iter():
                print(piece, end="", flush=True)
            print()

        asyncio.run(stream_async())
        return pieces


# What this printed on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, bfloat16 on
# an AVX512-BF16 CPU), in-process:
# The lighthouses of the 19th century were a beacon of hope and resilience in the face of
# unimaginable challenges. One day, a group of brave
# [32 pieces]
# <|im_start|>system ... <|im_start|>assistant
# Alex grew up surrounded by robots, constantly surrounded by them. He used to work at
# RoboticsCorp, where he helped in construction by helping out with robotic task<|im_end|>


if __name__ == "__main__":
    main()
