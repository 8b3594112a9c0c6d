"""`ModelRunner`: owns the model, the KV memory, the attention backend and the decode executor;
runs one forward.

It sizes the KV pool (from `max_total_tokens`, or a fraction of free memory), loads the weights
(prepared for the CPU by `platforms.cpu.prepare` there), and turns a `ForwardBatch` into
float32 logits for the rows the scheduler asked for. Extends run eagerly through the model and
its attention backend; decode steps go through the one decode executor picked at start-up
(`arborlm.runtime.decode_executor`) where it takes them. It does not decide what runs: that is
the scheduler's job.

With `tp_size` > 1 the runner is one tensor-parallel rank: rank 0's (built without `tp`)
starts the other ranks (`distributed.launch.TPLeader`) and broadcasts each batch to them before
running it; a worker rank's is built with its `TPGroup` and driven by `distributed.worker`.
Every rank holds its shard of the weights and a KV pool of its KV heads with the same slots
(the smallest pool any rank can hold).
"""

from __future__ import annotations

import logging

import psutil
import torch

from arborlm.errors import InvalidRequestError, ModelLoadError
from arborlm.runtime import startup
from arborlm.runtime.attention.registry import create_attention_backend
from arborlm.runtime.config import EngineConfig
from arborlm.runtime.decode_executor import DecodeExecutor, DecodeParts
from arborlm.runtime.distributed.group import TPGroup
from arborlm.runtime.distributed.shard import TPShard
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.memory_pool import KVPool, PagedAllocator, ReqToTokenPool
from arborlm.runtime.platforms.cpu.capabilities import kernel_instructions
from arborlm.runtime.platforms.registry import choose_decode_executor

logger = logging.getLogger(__name__)

# Cap on the default pool size, so that a default CPU engine does not reserve tens of GB.
DEFAULT_MAX_POOL_TOKENS = 262_144


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        self.config = config
        args, mc = config.args, config.model
        self.leader = None  # rank 0 of tensor parallelism: the other ranks
        if tp is None and args.tp_size > 1:
            from arborlm.runtime.distributed.launch import TPLeader, threads_per_rank

            shard = TPShard.of(mc, 0, args.tp_size)  # the model splits so (else ModelLoadError)
            if args.quantization is not None:
                from arborlm.runtime.platforms.cpu.quant_loading import check_tp_blocks

                check_tp_blocks(mc, args.quantization, shard)  # whole blocks on each rank
            if args.node_rank != 0:
                raise InvalidRequestError(
                    f"node_rank {args.node_rank} runs only its tensor-parallel ranks, not an "
                    f"engine: start it with `arborlm serve --node-rank {args.node_rank}`",
                    "node_rank")
            startup.phase("starting tensor-parallel ranks")
            torch.set_num_threads(threads_per_rank(args))
            self.leader = TPLeader(config)
            tp = self.leader.group
        try:
            self._build(config, tp)
        except RuntimeError as e:  # a failed collective (or another rank gone) while starting
            if self.leader is None:
                raise
            self.leader.shutdown(wait=False)
            raise self.leader.failure(e) from e
        except BaseException:
            if self.leader is not None:
                self.leader.shutdown(wait=False)
            raise

    def _build(self, config: EngineConfig, tp: TPGroup | None) -> None:
        from arborlm.runtime.models.registry import load_model

        args, mc = config.args, config.model
        self.tp = tp
        self.device = args.device if tp is None else tp.device
        cpu = self.device == "cpu"
        if cpu:
            from arborlm.runtime.platforms.cpu import prepare

            prepare.keep_cpu_allocations()
        torch.manual_seed(args.random_seed)
        self.model = load_model(mc, device=self.device, tp=tp, quantization=args.quantization)
        self.shard = self.model.shard
        self.deterministic = self._deterministic_holds()
        if self.deterministic and args.quantization is not None:
            from arborlm.runtime.platforms.cpu.quant_linear import pin_path

            logger.info("packed linears pinned to quant_linear's %s path (batch-invariant)",
                        pin_path(self.model))
        self.weight_arena = None  # keeps the weights' huge-page mapping alive (CPU)
        if cpu:
            self.weight_arena = prepare.prepare_weights(
                self.model, compiled=args.enable_torch_compile, deterministic=self.deterministic)
        self.vocab_size = mc.vocab_size
        self.page_size = args.page_size
        startup.phase("allocating the KV pool")
        num_slots = self._pool_slots()
        if tp is not None:
            num_slots = tp.min_int(num_slots)  # the same slots on every rank
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests + 2,
                                                mc.context_length + self.page_size,
                                                device=self.device)
        self.kv_pool = KVPool(num_slots, mc.num_layers, self.shard.num_kv_heads, mc.head_dim,
                              mc.dtype, device=self.device)
        self.allocator = PagedAllocator(num_slots, self.page_size)
        self.attn_backend = create_attention_backend(config.attention_backend, self.device,
                                                     deterministic=self.deterministic)
        logger.info("KV pool: %d tokens (%d pages of %d), %s, backend %s",
                    self.allocator.total_size, self.allocator.num_pages - 1, self.page_size,
                    mc.dtype, config.attention_backend)
        startup.phase("warming up")
        self.decode_parts = DecodeParts(
            model=self.model, kv_pool=self.kv_pool, req_to_token_pool=self.req_to_token_pool,
            attn_backend=self.attn_backend, device=self.device, args=args,
            deterministic=self.deterministic, tp_size=1 if tp is None else tp.size)
        self.decode: DecodeExecutor = choose_decode_executor(self.decode_parts)
        logger.info("decode executor: %s", type(self.decode).__name__)
        if self.device == "cpu" and not kernel_instructions(torch.float32):
            logger.warning("this CPU lacks AVX-512: most of ArborLM's CPU kernels (panel "
                           "linears, their fused decode step, decode attention, deterministic "
                           "inference) do not run; float linears run on oneDNN and attention on "
                           "torch, several times slower. With --quantization (gguf for a GGUF "
                           "file) linears compute from packed blocks in AVX2 and decode steps run "
                           "fused (docs/performance.md, 'On a CPU without AVX-512')")
        if tp is not None:
            tp.set_op_timeout(args.dist_timeout)  # started: from now on a stall is a failure

    def _deterministic_holds(self) -> bool:
        """Whether this engine runs deterministic inference: wanted (`EngineConfig`), and the
        kernels it needs built and fitting the model's attention heads. Asked for explicitly
        where they are not, it is an error; by default it is then off, and logged."""
        if not self.config.deterministic:
            logger.info("deterministic inference: off")
            return False
        from arborlm.runtime.platforms.cpu.prepare import deterministic_kernels_missing

        mc = self.config.model
        shard = self.model.shard  # this rank's heads
        missing = deterministic_kernels_missing(mc.dtype, shard.num_heads, shard.num_kv_heads,
                                                mc.head_dim)
        if missing is None:
            logger.info("deterministic inference: on (batch-invariant kernels)")
            return True
        if self.config.args.enable_deterministic_inference:
            raise ModelLoadError(f"enable_deterministic_inference cannot hold: {missing}")
        logger.warning("deterministic inference: off, as %s", missing)
        return False

    def _pool_slots(self) -> int:
        args, mc = self.config.args, self.config.model
        per_token = KVPool.bytes_per_token(mc.num_layers, self.shard.num_kv_heads, mc.head_dim,
                                           mc.dtype)
        draft = self.config.draft_model
        if draft is not None:  # the draft model's pool holds as many tokens, in the same budget
            per_token += KVPool.bytes_per_token(draft.num_layers, draft.num_kv_heads,
                                                draft.head_dim, draft.dtype)
        if args.max_total_tokens is not None:
            if args.max_total_tokens < 2 * self.page_size:
                raise InvalidRequestError(
                    f"max_total_tokens must be at least {2 * self.page_size}", "max_total_tokens")
            tokens = args.max_total_tokens
        else:
            if self.device.startswith("cuda"):
                free = torch.cuda.mem_get_info()[0]
            else:
                free = psutil.virtual_memory().available
            tokens = int(free * args.mem_fraction) // per_token
            tokens = min(tokens, DEFAULT_MAX_POOL_TOKENS,
                         args.max_running_requests * mc.context_length)
        pages = -(-tokens // self.page_size) + 1  # +1: page 0 is the reserved padding page
        return pages * self.page_size

    def can_run_ahead(self, batch: ForwardBatch) -> bool:
        """Whether `run_ahead` takes this greedy decode batch (the decode executor says)."""
        return self.decode.can_run_ahead(batch)

    @torch.inference_mode()
    def run_ahead(self, batch: ForwardBatch, slots: torch.Tensor) -> torch.Tensor:
        """Greedy tokens `[S, B]` of S decode steps in one call, the first being `batch`'s
        (`slots` `[S, B]`). Needs `can_run_ahead`."""
        return self.decode.run_ahead(batch, slots)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[N, vocab]` float32 for `batch.logits_indices` (all rows if None).

        Rank 0 of tensor parallelism first sends the batch to the other ranks; a rank that
        died (or stopped answering) ends the engine with `EngineDeadError` naming it."""
        if self.leader is None:
            return self._forward(batch)
        try:
            self.leader.send(batch)
            return self._forward(batch)
        except RuntimeError as e:  # a failed collective (torch's DistBackendError among them)
            raise self.leader.failure(e) from e

    def idle(self) -> None:
        """The scheduler has nothing to run: rank 0 tells the other ranks it still lives."""
        if self.leader is not None:
            try:
                self.leader.keep_alive()
            except RuntimeError as e:
                raise self.leader.failure(e) from e

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do without them); safe twice."""
        if self.leader is not None:
            self.leader.shutdown()
            self.leader = None

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.decode.can_run(batch):
            return self.decode.run(batch)
        batch.attn_backend = self.attn_backend
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.model(batch)
        return self.model.compute_logits(hidden)
