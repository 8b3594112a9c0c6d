"""How the examples choose where to run: `--url` for an ArborLM server (or any server with the
same native API), else an in-process engine on `--model-path` (default: SmolLM2-135M-Instruct,
fetched once into ArborLM's cache).
"""

from __future__ import annotations

import argparse
from typing import Any


def backend_from_args(description: str, argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=None, help="server URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--model-path", default=None, help="model directory or .gguf file "
                        "(in-process)")
    args = parser.parse_args(argv)
    import arborlm

    if args.url:
        return arborlm.RuntimeEndpoint(args.url)
    return arborlm.EngineBackend(model_path=args.model_path)
