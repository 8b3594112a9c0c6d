"""Starting the tensor-parallel ranks: rank 0's `TPLeader`, and a node's worker ranks.

Node 0's rank 0 is the engine's model runner (in the scheduler process, or the in-process
engine's scheduler thread). When `tp_size` > 1 its `TPLeader` starts the node's other ranks as
processes (`python -m arborlm.runtime.distributed.worker`), listens at `dist_init_addr` (a free
loopback port on one node) until every rank has joined, and sends them the resolved
`EngineConfig`, so the ranks of other nodes need only the rendezvous options. A node other
than 0 (`arborlm serve --node-rank N`) runs `run_node_ranks`: its ranks, until they exit.

Failure: a rank that dies closes its connections, so rank 0's next collective fails at once;
`TPLeader.failure` names the dead rank and its exit code, and the model runner raises it as
`EngineDeadError`, which ends the engine like any other scheduler failure (the multi-process
client then restarts it). Worker ranks exit when rank 0 goes away (their collectives fail, or
their parent process is gone). Each rank runs `threads_per_rank` torch threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from arborlm.errors import EngineDeadError
from arborlm.runtime.config import EngineArgs, EngineConfig
from arborlm.runtime.distributed.broadcast import CommandKind, RankCommand, forward_command
from arborlm.runtime.distributed.group import TPGroup, connect, free_loopback_address
from arborlm.runtime.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

WORKER_MODULE = "arborlm.runtime.distributed.worker"
KEEP_ALIVE_S = 5.0  # an idle rank 0 tells the others it lives at most this often
JOIN_TIMEOUT_S = 600.0  # the ranks' start (joining, loading weights) may take this long
JOIN_POLL_S = 0.2
STOP_WAIT_S = 10.0


def local_ranks(args: EngineArgs, node_rank: int) -> range:
    """The global ranks that run on node `node_rank`."""
    per_node = args.tp_size // args.nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def rank_device(device: str, local_rank: int) -> str:
    """A rank's device: `cuda:<local rank>` (one GPU per rank) on CUDA, else `device`."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def threads_per_rank(args: EngineArgs) -> int:
    """CPU threads for each of a node's ranks: the node's cores shared out evenly."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // (args.tp_size // args.nnodes))


def start_worker(args: EngineArgs, rank: int, addr: str) -> subprocess.Popen:
    """Start worker rank `rank` (on this node), to meet rank 0 at `addr`."""
    local = rank - local_ranks(args, args.node_rank).start
    threads = threads_per_rank(args)
    cmd = [sys.executable, "-m", WORKER_MODULE, "--rank", str(rank),
           "--tp-size", str(args.tp_size), "--dist-init-addr", addr,
           "--device", rank_device(args.device, local),
           "--timeout", str(max(JOIN_TIMEOUT_S, args.dist_timeout)),
           "--threads", str(threads), "--parent-pid", str(os.getpid())]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


class TPLeader:
    """Rank 0: the node's worker ranks, the group, and the commands sent to the ranks."""

    def __init__(self, config: EngineConfig):
        args = config.args
        assert args.node_rank == 0 and args.tp_size > 1
        addr = args.dist_init_addr or free_loopback_address()
        self.workers = {rank: start_worker(args, rank, addr)
                        for rank in local_ranks(args, 0) if rank != 0}
        self._last_sent = time.monotonic()
        self._keep_alive_s = min(KEEP_ALIVE_S, args.dist_timeout / 4)
        self.keep_alives = 0  # sent so far
        try:
            self.group = self._join(addr, args)
            self.group.broadcast_object(config)
        except BaseException as e:
            self.shutdown(wait=False)
            raise self.failure(e) from e
        logger.info("tensor parallelism: %d ranks over %d node(s), rendezvous %s", args.tp_size,
                    args.nnodes, addr)

    def _join(self, addr: str, args: EngineArgs) -> TPGroup:
        """Connect as rank 0, noticing at once a local rank that dies before it joins."""
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["group"] = connect(addr, 0, args.tp_size, rank_device(args.device, 0),
                                          max(JOIN_TIMEOUT_S, args.dist_timeout))
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                result["error"] = e

        thread = threading.Thread(target=run, name="arborlm-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(JOIN_POLL_S)
            dead = self._dead_worker()
            if dead is not None and thread.is_alive():
                raise EngineDeadError(f"{dead} before joining the group")
        if "error" in result:
            raise result["error"]
        return result["group"]

    def _dead_worker(self) -> str | None:
        for rank, proc in self.workers.items():
            if proc.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code " \
                       f"{proc.returncode}"
        return None

    def failure(self, exc: BaseException) -> EngineDeadError:
        """The error that ends the engine after a collective (or the start) failed with `exc`:
        names a local rank that died, waiting briefly for its exit to show."""
        if isinstance(exc, EngineDeadError):
            return exc
        deadline = time.monotonic() + 2.0
        while (dead := self._dead_worker()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        what = dead or "a tensor-parallel step failed (a rank stopped answering, or a rank on "\
            "another node is gone)"
        return EngineDeadError(f"{what}: {type(exc).__name__}: {exc}")

    def send(self, batch: ForwardBatch) -> None:
        """Broadcast `batch` (a FORWARD) to the other ranks, which then run it too."""
        self._send(forward_command(batch))

    def keep_alive(self) -> None:
        """While rank 0 idles: a KEEP_ALIVE every `KEEP_ALIVE_S` (a quarter of `dist_timeout`
        when that is shorter), so that the others' wait for the next batch never times out."""
        if time.monotonic() - self._last_sent >= self._keep_alive_s:
            self._send(RankCommand(CommandKind.KEEP_ALIVE))
            self.keep_alives += 1

    def _send(self, cmd: RankCommand) -> None:
        dead = self._dead_worker()
        if dead is not None:
            raise EngineDeadError(dead)
        self.group.broadcast_object(cmd)
        self._last_sent = time.monotonic()

    def shutdown(self, wait: bool = True) -> None:
        """Stop the ranks: a STOP when they can hear it, then terminate what is left."""
        group = getattr(self, "group", None)
        if wait and group is not None and self._dead_worker() is None:
            with contextlib.suppress(Exception):
                group.broadcast_object(RankCommand(CommandKind.STOP))
        for proc in self.workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_WAIT_S if wait else 0.1)
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_node_ranks(args: EngineArgs) -> int:
    """Node `node_rank` > 0: run its ranks until they exit; the worst exit code (0 when all
    stopped cleanly). A rank that fails stops the node's others."""
    assert args.node_rank > 0, "node 0 runs the engine"
    if args.dist_init_addr is None:
        raise ValueError("a node other than 0 needs dist_init_addr (host:port of node 0)")
    procs = [start_worker(args, rank, args.dist_init_addr)
             for rank in local_ranks(args, args.node_rank)]
    logger.info("node %d of %d: ranks %s waiting for node 0 at %s", args.node_rank, args.nnodes,
                list(local_ranks(args, args.node_rank)), args.dist_init_addr)
    failed = False
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(JOIN_POLL_S)
        failed = any(p.returncode for p in procs if p.poll() is not None)
    except BaseException:
        failed = True  # (a signal): the ranks stop with this process
        raise
    finally:
        for p in procs:
            if failed and p.poll() is None:
                p.terminate()
        codes = [p.wait() for p in procs]
    return max(codes, key=abs)
