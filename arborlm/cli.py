"""The `arborlm` command line: `arborlm generate` (offline), `serve` and `router` (HTTP)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _generate(argv: list[str]) -> int:
    from arborlm.runtime.config import DType, choices

    parser = argparse.ArgumentParser(
        prog="arborlm generate",
        description="Generate from a model in-process (default: SmolLM2-135M-Instruct, "
                    "fetched once into the cache).")
    parser.add_argument("prompt", nargs="*", default=None, help="prompt(s); default: two demo "
                        "prompts")
    parser.add_argument("--model-path", default=None,
                        help="Hugging Face model directory or .gguf file (default: "
                             "SmolLM2-135M-Instruct; random-llama-40m: the built-in "
                             "random-weight model)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default=DType.AUTO.value, choices=choices(DType))
    parser.add_argument("--json", action="store_true", help="print the full native responses")
    args = parser.parse_args(argv)
    from arborlm import Engine

    prompts = args.prompt or ["Once upon a time", "The capital of France is"]
    engine = Engine(args.model_path, dtype=args.dtype)
    start = time.perf_counter()
    outs = engine.generate(prompts, {"max_new_tokens": args.max_new_tokens,
                                     "temperature": args.temperature})
    elapsed = time.perf_counter() - start
    tokens = 0
    for prompt, out in zip(prompts, outs):
        tokens += out["meta_info"]["completion_tokens"]
        if args.json:
            print(json.dumps(out))
        else:
            print(f"--- {prompt!r}\n{out['text']!r}")
    print(f"[{len(prompts)} prompts, {tokens} tokens in {elapsed:.2f} s, "
          f"{tokens / elapsed:.1f} tok/s, model {engine.config.model.path}]")
    engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    from arborlm.routing.cli import router_main

    commands = {"generate": _generate, "router": router_main}
    try:
        from arborlm.server.cli import serve_main

        commands["serve"] = serve_main
    except ImportError:
        pass
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(f"usage: arborlm {{{','.join(commands)}}} [options]  (arborlm COMMAND --help)")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
