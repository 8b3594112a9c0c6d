"""`TPGroup`: the tensor-parallel ranks of one engine, over a torch.distributed process group.

Built on torch.distributed's own backends — gloo on a CPU, NCCL on CUDA devices — through a
`TCPStore` rendezvous at `host:port` (rank 0 listens there). The group is a standalone
`ProcessGroup` object, not torch.distributed's process-global default group, so an engine can
be started, stopped and started again (or two engines live) in one process. Every collective
waits at most `op_timeout`: the join timeout while the ranks start (importing torch, loading
weights at their own pace), then the engine's `dist_timeout` once they run (`set_op_timeout`).
A peer that dies closes its connections, which fails the collectives of the others at once.

Not here: what is sent (`broadcast.py`), which weights a rank holds (`shard.py`), or starting
the ranks' processes (`launch.py`).
"""

from __future__ import annotations

import pickle
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # (torch.distributed does not export it)


class TPGroup:
    """Rank `rank` of `size` tensor-parallel ranks; the collectives the sharded model needs."""

    def __init__(self, rank: int, size: int, pg: Any, device: str, store: Any,
                 op_timeout: timedelta):
        assert 0 <= rank < size, (rank, size)
        self.rank, self.size = rank, size
        self.device = device
        self._pg = pg
        self._store = store  # the rendezvous store; rank 0's must outlive the group
        self.op_timeout = op_timeout

    @property
    def backend(self) -> str:
        """The torch.distributed backend the collectives run on: "nccl" or "gloo"."""
        return self._pg.name()

    def set_op_timeout(self, seconds: float) -> None:
        """From now on a collective fails after waiting `seconds` for the other ranks."""
        self.op_timeout = timedelta(seconds=seconds)

    def all_reduce(self, x: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or `op`) `x` over the ranks, in place; returns `x`."""
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = op, self.op_timeout
        self._pg.allreduce([x], opts).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` `[..., n]`, concatenated in rank order: `[..., size * n]`."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        opts = AllgatherOptions()
        opts.timeout = self.op_timeout
        self._pg.allgather([parts], [x], opts).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' `value`s."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` (pickled), on every rank; other ranks pass nothing."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        size = size.to(self.device)
        self._pg.broadcast([size], self._from_rank0()).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        data = data.to(self.device)
        self._pg.broadcast([data], self._from_rank0()).wait()
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())

    def _from_rank0(self) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.op_timeout
        return opts


def split_address(addr: str) -> tuple[str, int]:
    """"host:port" -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def free_loopback_address() -> str:
    """A "127.0.0.1:port" with a port free at the time of the call (single-node engines)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def connect(addr: str, rank: int, size: int, device: str, timeout_s: float) -> TPGroup:
    """Join the `size` ranks that meet at `addr` (rank 0 listens there) as `rank`.

    Waits up to `timeout_s` for the others, and so does every collective until
    `set_op_timeout`. CUDA ranks use NCCL (each on the device `device` names), CPU ranks gloo.
    """
    host, port = split_address(addr)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False)
    prefix = dist.PrefixStore("arborlm-tp", store)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefix, rank, size, opts)
    else:
        pg = dist.ProcessGroupGloo(prefix, rank, size, timeout)
    group = TPGroup(rank, size, pg, device, store, timeout)
    group.min_int(0)  # a first collective: every rank has joined
    return group
