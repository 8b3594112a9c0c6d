"""A worker rank of tensor parallelism: `python -m arborlm.runtime.distributed.worker`.

Joins the group at `--dist-init-addr`, receives the resolved `EngineConfig` from rank 0, loads
its shard of the model (`ModelRunner` with the group) and then runs what rank 0 broadcasts:
each FORWARD batch through the same forward as rank 0 (its logits are dropped: rank 0
samples), KEEP_ALIVEs, and a STOP that ends it with status 0. It owns no scheduler, cache,
tokenizer or socket of its own. A failed collective (rank 0 or another rank gone) ends it with
status 1, and so does the death of the process that started it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import torch

from arborlm.runtime.distributed.broadcast import CommandKind, forward_batch_of
from arborlm.runtime.distributed.group import connect

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def serve(rank: int, size: int, addr: str, device: str, timeout_s: float) -> None:
    """Join, load this rank's shard, and run rank 0's commands until a STOP."""
    from arborlm.runtime.model_runner import ModelRunner

    group = connect(addr, rank, size, device, timeout_s)
    config = group.broadcast_object()
    if device == "cpu":
        from arborlm.runtime.platforms.cpu import kernels as cpu_kernels

        cpu_kernels.build()
    runner = ModelRunner(config, tp=group)
    logger.info("tensor-parallel rank %d of %d ready", rank, size)
    while True:
        cmd = group.broadcast_object()
        if cmd.kind is CommandKind.STOP:
            return
        if cmd.kind is CommandKind.FORWARD:
            runner.forward(forward_batch_of(cmd, runner.req_to_token_pool, runner.kv_pool,
                                            runner.device))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A tensor-parallel worker rank (started by ArborLM).")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--dist-init-addr", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the others to join (then rank 0's dist_timeout)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parent-pid", type=int, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s [tp-rank-{a.rank}] %(levelname)s %(name)s: "
                               f"%(message)s")
    if a.parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(a.parent_pid,), daemon=True).start()
    torch.set_num_threads(a.threads)
    try:
        serve(a.rank, a.tp_size, a.dist_init_addr, a.device, a.timeout)
    except Exception as e:  # noqa: BLE001 - the exit status and this line are the report
        logger.error("tensor-parallel rank %d ends: %s: %s", a.rank, type(e).__name__, e)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter finalization: tearing down the group can block
