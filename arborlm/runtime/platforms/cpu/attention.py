"""The CPU attention backend: `torch_native` on a CPU, with ArborLM's kernels and caches.

The engine serves the `torch_native` backend name with this class on a CPU (the registry
`attention.registry`). It computes what the reference backend computes, laid out for CPU speed:

- Extend attends request by request: with ArborLM's causal kernel (`kernels.causal_attention`,
  flash attention over register tiles) where the CPU has AVX-512, else with
  `scaled_dot_product_attention`. A request with no cached prefix attends to its own new K/V
  straight from the projection (no read of the pool); one on a prefix gathers its slots once
  per layer. Requests of one extend batch on the same cached prefix (at least
  `cascade.CASCADE_MIN_PREFIX` shared slots) attend together instead (cascade extend): the
  shared prefix once for all their new tokens (`kernels.prefix_attention` straight from the
  pool where it runs), their own keys padded in one more call, the parts merged by their
  log-sum-exps (`cascade.py`).
- Decode gathers every request's keys into one padded batch, laid out KV-head-major
  (`[Hkv * B, L, D]`), with a single `index_select` on the pool viewed as rows of one head;
  attention is then ArborLM's kernel (`kernels.decode_attention`: one pass per (KV head,
  request) over that request's own keys, float32 sums) where it runs, else the reference's two
  batched matmuls around a float32 softmax.
- Consecutive decode steps of the same requests keep the padded batch in a `DecodeWorkspace`
  and append each step's new token to it, instead of gathering the whole history again. The
  backend is therefore stateful: one instance serves one model runner (as the registry makes).
- Cascade decode: requests of a decode batch that share a cached prefix (the radix cache gives
  them the same slots: a system prompt, few-shot examples, a fork's parent) form groups; each
  group's prefix K/V is read once for all its members instead of once per request, and its
  part joins each member's own part by their log-sum-exps, as one softmax over both would. All
  groups' prefixes run in the same few batched matmuls (padded to the longest prefix and the
  largest group), and the workspace keeps the prefixes too while the batch continues.

With deterministic inference (the engine's default in bfloat16, see docs/determinism.md) there
is no cascade, and every token of an extend attends on its own through the decode kernel's
arithmetic (`kernels.paged_attention_rows`, straight from the pool): a token's attention is
then the same whether it was prefilled in one chunk or several, decoded, batched with other
requests or found its prefix in the radix cache.

Not here: sliding windows, custom masks, CUDA graphs (the gather is sized by host lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arborlm.runtime.attention.base import AttentionLayerSpec
from arborlm.runtime.attention.torch_native import (
    TorchNativeBackend,
    attend_causal,
    attend_padded,
    head_rows,
    padding_mask,
)
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.platforms.cpu import cascade
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.cascade import (
    CascadeMeta,
    ExtendGroup,
    attend_extend_group,
    cascade_meta,
    extend_groups,
    find_groups,
    to_request_rows,
)
from arborlm.runtime.platforms.cpu.decode_workspace import DecodeWorkspace, Layout


@dataclass
class _DecodeMeta:
    index: torch.Tensor | None  # [Hkv * B * L] int64 rows of the pool seen as [slots * Hkv, D]
    mask: torch.Tensor  # [1, B, 1, L] float32: 0 for real keys, -inf for padding
    width: int  # L: own (non-shared) keys per request, padded
    cascade: CascadeMeta | None  # the groups sharing a prefix, or None
    workspace: str | None = None  # "fill" (copy the gather in) / "append" (no gather) / None
    # [Hkv * B] rows of the workspace seen as [Hkv * B * cap, D] that each request's new token
    # goes to, head-major, for "append".
    append_index: torch.Tensor | None = None
    lens: torch.Tensor | None = None  # [B] own keys per request (for the CPU kernel)
    kernel: bool = False  # own keys attended with `cpu_kernels.decode_attention`


@dataclass
class _ExtendMeta:
    slots: list[torch.Tensor | None]  # per request: [seq_len] KV slots, None without a prefix
    starts: list[int]  # first row of each request's new tokens, and the total at the end
    groups: list[ExtendGroup] = field(default_factory=list)  # CPU cascade groups (members
    # are then attended by `attend_extend_group`, not one by one)
    kernel: bool = False  # a CPU pool the attention kernels take: requests attend one by one
    # with `cpu_kernels.causal_attention` (where the head shape fits too)


@dataclass
class _TokenKeys:
    """An extend's metadata under deterministic inference: each new token's `req_to_token` row
    and key count (its position + 1), `[T]` each; every token attends on its own, as a decode
    step's query would (`cpu_kernels.paged_attention_rows`)."""

    rows: torch.Tensor
    lens: torch.Tensor


class CpuAttentionBackend(TorchNativeBackend):
    """`torch_native` on a CPU: kernels, decode workspace, cascade, deterministic mode."""

    def __init__(self, deterministic: bool = False) -> None:
        # Batch-invariant attention: every token of an extend attends as a decode step's query
        # would (`cpu_kernels.paged_attention_rows`, the decode kernel's arithmetic), and no
        # cascade: a token's result is then the same however its sequence was split into steps
        # or batched. Needs the CPU kernels (the model runner checks).
        self.deterministic = deterministic
        self.workspace = DecodeWorkspace()
        # (layout, its offsets, its cascade groups) of the last appending step; see
        # `_layout_tensors`.
        self._layout_cache: tuple[Layout | None, torch.Tensor | None, CascadeMeta | None] = (
            None, None, None)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode:
            batch.attn_metadata = self._decode_metadata(batch)
        else:
            self.workspace.invalidate()
            batch.attn_metadata = self._extend_metadata(batch)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """As the base class, except that the new tokens' K/V are passed on from `k`/`v`
        (fresh prompts attend to them directly; decode appends them to the workspace)."""
        q = q.view(-1, layer.num_heads, layer.head_dim)
        k = k.view(-1, layer.num_kv_heads, layer.head_dim)
        v = v.view(-1, layer.num_kv_heads, layer.head_dim)
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.mode.is_decode:
            out = self._decode(q, k, v, layer, batch)
        else:
            out = self._extend(q, k, v, layer, batch)
        return out.reshape(-1, layer.num_heads * layer.head_dim)

    # --- extend -------------------------------------------------------------------------------

    def _extend_metadata(self, batch: ForwardBatch) -> _ExtendMeta | _TokenKeys:
        if self.deterministic:
            ext = torch.tensor(batch.extend_seq_lens_cpu, device=batch.req_pool_indices.device)
            return _TokenKeys(rows=batch.req_pool_indices.repeat_interleave(ext),
                              lens=batch.positions + 1)
        table = batch.req_to_token_pool.req_to_token
        kernel = self._kernel_runs(batch)
        slots: list[torch.Tensor | None] = []
        rows = batch.req_pool_indices.tolist()
        for row, prefix, ext in zip(rows, batch.extend_prefix_lens_cpu,
                                    batch.extend_seq_lens_cpu):
            if prefix == 0:
                slots.append(None)  # plain causal over its own new tokens
                continue
            slots.append(table[row, :prefix + ext])
        starts = [0]
        for ext in batch.extend_seq_lens_cpu:
            starts.append(starts[-1] + ext)
        groups = extend_groups(table, rows, slots, starts, batch.extend_prefix_lens_cpu,
                               cascade.CASCADE_MIN_PREFIX, cascade.CASCADE_EXTEND_MAX_NEW)
        return _ExtendMeta(slots=slots, starts=starts, groups=groups,
                           kernel=kernel)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        """The interface's form: the new tokens' K/V are read back from the pool."""
        k_buf = batch.kv_pool.k_buffer[layer.layer_id]
        v_buf = batch.kv_pool.v_buffer[layer.layer_id]
        loc = batch.out_cache_loc
        return self._extend(q, k_buf[loc], v_buf[loc], layer, batch)

    @staticmethod
    def _extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec,
                batch: ForwardBatch) -> torch.Tensor:
        """q `[T, H, D]`, k/v `[T, Hkv, D]` of the new tokens -> `[T, H, D]`."""
        meta: _ExtendMeta | _TokenKeys = batch.attn_metadata
        k_buf = batch.kv_pool.k_buffer[layer.layer_id]
        v_buf = batch.kv_pool.v_buffer[layer.layer_id]
        if isinstance(meta, _TokenKeys):  # deterministic: each token as a decode query
            return cpu_kernels.paged_attention_rows(
                q, k_buf, v_buf, batch.req_to_token_pool.req_to_token, meta.rows, meta.lens,
                layer.scaling)
        kernel = meta.kernel and k_buf.dtype == q.dtype and cpu_kernels.attention_fits(
            q.dtype, layer.num_heads // layer.num_kv_heads, layer.head_dim)
        out = torch.empty_like(q)
        starts = meta.starts
        grouped = set()
        for group in meta.groups:
            attend_extend_group(q, k_buf, v_buf, layer, group, out, kernel)
            grouped.update(group.members)
        for i, slots in enumerate(meta.slots):
            if i in grouped:
                continue
            start, end = starts[i], starts[i + 1]
            if slots is None:
                ki, vi = k[start:end], v[start:end]  # [ext, Hkv, D]
            else:
                ki, vi = k_buf.index_select(0, slots), v_buf.index_select(0, slots)  # [S,Hkv,D]
            if kernel:
                out[start:end] = cpu_kernels.causal_attention(q[start:end], ki, vi,
                                                              layer.scaling)
                continue
            out[start:end] = attend_causal(q[start:end], ki, vi, layer.scaling,
                                           len(ki) - (end - start))
        return out

    # --- decode -------------------------------------------------------------------------------

    def _decode_metadata(self, batch: ForwardBatch) -> _DecodeMeta:
        ws = self.workspace
        kernel = self._kernel_runs(batch)
        if ws.continues(batch):
            offsets, groups = self._layout_tensors(batch)
            own_lens = batch.seq_lens - offsets  # [B]
            index = ws.append_rows(own_lens - 1)  # [Hkv * B]
            width = self._workspace_width(batch, own_lens, kernel)
            return _DecodeMeta(index=None, mask=padding_mask(own_lens, width), width=width,
                               cascade=groups, workspace="append", append_index=index,
                               lens=own_lens, kernel=kernel)
        meta, layout, own_lens = self._gather_metadata(batch, cascade=not self.deterministic)
        meta.lens, meta.kernel = own_lens, kernel
        if ws.prepare(batch, layout):
            meta.workspace = "fill"
            width = self._workspace_width(batch, own_lens, kernel)
            if width != meta.width:
                meta.mask, meta.width = padding_mask(own_lens, width), width
        return meta

    @staticmethod
    def _kernel_runs(batch: ForwardBatch) -> bool:
        """Whether this step's attention runs on ArborLM's kernels (a pool of float32 or
        bfloat16 and the kernels built; the layers also check the head shape)."""
        return cpu_kernels.attention_available(batch.kv_pool.dtype)

    def _layout_tensors(self, batch: ForwardBatch) -> tuple[torch.Tensor, CascadeMeta | None]:
        """Offsets `[B]` and cascade groups of the workspace's layout, built once per layout
        (the workspace replaces its layout only when the batch is refilled or requests leave)."""
        layout = self.workspace.layout
        if self._layout_cache[0] is not layout:
            offsets = torch.tensor(layout.offsets, device=batch.seq_lens.device)
            groups = cascade_meta(None, layout, batch.kv_pool.num_kv_heads)
            self._layout_cache = (layout, offsets, groups)
        return self._layout_cache[1], self._layout_cache[2]

    def _workspace_width(self, batch: ForwardBatch, own_lens: torch.Tensor,
                         kernel: bool) -> int:
        """Own keys attended per request from the workspace. The CPU kernel and float32: the
        longest (the kernel reads each row's own count; float32's strided view is fastest);
        half precision: the whole capacity, as its batched matmuls are faster on a contiguous
        operand than on the strided one, padding and all."""
        if kernel or batch.kv_pool.dtype == torch.float32:
            return int(own_lens.max())
        return self.workspace.capacity

    @staticmethod
    def _gather_metadata(batch: ForwardBatch,
                         cascade: bool = True) -> tuple[_DecodeMeta, Layout, torch.Tensor]:
        """Metadata to gather every request's keys from the pool, with its `Layout` (cascade
        groups found here, unless not `cascade`) and each request's own key count `[B]`."""
        hkv, bsz = batch.kv_pool.num_kv_heads, batch.batch_size
        width = max(batch.seq_lens_cpu)
        table = batch.req_to_token_pool.req_to_token
        if bsz == 1:  # no padding, no sharing: a slice of the request's row
            slots = table[int(batch.req_pool_indices[0]), :width]  # [L]
            mask = torch.zeros((1, 1, 1, width), dtype=torch.float32, device=slots.device)
            meta = _DecodeMeta(index=head_rows(slots, hkv), mask=mask, width=width, cascade=None)
            return meta, Layout([0], [-1]), batch.seq_lens
        slots = table[batch.req_pool_indices, :width]  # [B, L]
        pos = torch.arange(width, device=slots.device)
        slots = slots * (pos[None, :] < batch.seq_lens[:, None])  # padding -> slot 0
        layout = find_groups(slots, batch.seq_lens_cpu) if cascade else \
            Layout([0] * bsz, [-1] * bsz)
        groups = cascade_meta(slots, layout, hkv)
        own_slots, own_lens = slots, batch.seq_lens
        if groups is not None:  # each request's keys after its group's prefix
            offsets = torch.tensor(layout.offsets, device=slots.device)
            own_lens = batch.seq_lens - offsets  # [B]
            own_pos = offsets[:, None] + pos[None, :int(own_lens.max())]  # [B, W]
            own_slots = slots.gather(1, own_pos.clamp_(max=width - 1))
            own_slots = own_slots * (own_pos < batch.seq_lens[:, None])
        own_width = own_slots.shape[1]
        mask = padding_mask(own_lens, own_width)
        meta = _DecodeMeta(index=head_rows(own_slots, hkv), mask=mask, width=own_width,
                           cascade=groups)
        return meta, layout, own_lens

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        """The interface's form: the new tokens' K/V are read back from the pool."""
        loc = batch.out_cache_loc
        return self._decode(q, batch.kv_pool.k_buffer[layer.layer_id][loc],
                            batch.kv_pool.v_buffer[layer.layer_id][loc], layer, batch)

    def _keys(self, k_new: torch.Tensor, v_new: torch.Tensor, layer: AttentionLayerSpec,
              batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's padded own keys and values, `[Hkv * B, L, D]` each."""
        meta: _DecodeMeta = batch.attn_metadata
        lid, d = layer.layer_id, layer.head_dim
        if meta.workspace == "append":
            self.workspace.append(lid, meta.append_index, k_new, v_new)
            return self.workspace.view(lid, meta.width)
        k = batch.kv_pool.k_buffer[lid].view(-1, d).index_select(0, meta.index)  # [Hkv*B*L, D]
        v = batch.kv_pool.v_buffer[lid].view(-1, d).index_select(0, meta.index)
        width = meta.index.numel() // (layer.num_kv_heads * batch.batch_size)  # L gathered
        if meta.workspace == "fill":
            shape = (layer.num_kv_heads, -1, width, d)
            self.workspace.fill(lid, k.view(shape), v.view(shape))
            if width != meta.width:
                return self.workspace.view(lid, meta.width)
        return k.view(-1, width, d), v.view(-1, width, d)

    def _prefix_keys(self, layer: AttentionLayerSpec,
                     batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The cascade groups' shared K and V, `[Hkv * NG, P, D]` each."""
        meta: _DecodeMeta = batch.attn_metadata
        lid, d, c = layer.layer_id, layer.head_dim, meta.cascade
        if meta.workspace == "append":
            return self.workspace.prefix(lid)
        k = batch.kv_pool.k_buffer[lid].view(-1, d).index_select(0, c.index)  # [Hkv*NG*P, D]
        v = batch.kv_pool.v_buffer[lid].view(-1, d).index_select(0, c.index)
        shape = (layer.num_kv_heads, c.num_groups, c.width, d)
        if meta.workspace == "fill":
            self.workspace.fill_prefix(lid, k.view(shape), v.view(shape))
        return k.view(-1, c.width, d), v.view(-1, c.width, d)

    def _decode(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """q `[B, H, D]`, the new tokens' k/v `[B, Hkv, D]` (already in the pool) -> `[B, H, D]`."""
        meta: _DecodeMeta = batch.attn_metadata
        bsz, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // hkv
        k, v = self._keys(k_new, v_new, layer, batch)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qh = q.view(bsz, hkv, group, d).transpose(0, 1).reshape(hkv * bsz, group, d)
        if meta.kernel and cpu_kernels.attention_fits(q.dtype, group, d):
            out, lse = cpu_kernels.decode_attention(qh, k, v, meta.lens, layer.scaling)
        else:
            out, lse = self._own_attention(qh, k, v, meta, layer)
        if meta.cascade is not None:
            kp, vp = self._prefix_keys(layer, batch)
            out = self._with_prefix(qh, out, lse, kp.to(q.dtype), vp.to(q.dtype),
                                    meta.cascade, layer)
        return out.view(hkv, bsz, group, d).transpose(0, 1).reshape(bsz, layer.num_heads, d)

    @staticmethod
    def _own_attention(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: _DecodeMeta,
                       layer: AttentionLayerSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention over each request's own keys as two batched matmuls around a float32
        softmax: `[Hkv * B, G, D]`, and with cascade groups, each query's log-sum-exp
        `[Hkv * B, G]` (float32, as is the output then: `_with_prefix` rounds once)."""
        if meta.cascade is None:
            return attend_padded(qh, k, v, meta.mask, layer.scaling), None
        rows, group, _ = qh.shape
        hkv = rows // meta.mask.shape[1]
        scores = torch.bmm(qh, k.transpose(1, 2)).float()  # [Hkv * B, G, L]
        scores = scores.view(hkv, -1, group, meta.width).mul_(layer.scaling).add_(meta.mask)
        top = scores.amax(-1, keepdim=True)
        weights = scores.sub_(top).exp_()
        total = weights.sum(-1, keepdim=True)  # [Hkv, B, G, 1]
        out = torch.bmm(weights.to(qh.dtype).view(rows, group, meta.width), v).float()
        return out.div_(total.view(rows, group, 1)), top.add_(total.log()).view(rows, group)

    @staticmethod
    def _with_prefix(qh: torch.Tensor, own: torch.Tensor, own_lse: torch.Tensor,
                     kp: torch.Tensor, vp: torch.Tensor, c: CascadeMeta,
                     layer: AttentionLayerSpec) -> torch.Tensor:
        """Decode attention over (group prefix, own keys): `[Hkv * B, G, D]`.

        `own` `[Hkv * B, G, D]` is the attention over each request's own keys and `own_lse`
        its log-sum-exp; `kp`/`vp` `[Hkv * NG, P, D]` the groups' prefixes. Each KV head's
        queries of a group's members attend to its prefix in one batched matmul over all
        groups; the two parts are then weighted by their shares of one softmax over both
        (their log-sum-exps). Requests in no group get no prefix weight.
        """
        rows, group, d = qh.shape
        p, ng, m = c.width, c.num_groups, c.max_members
        hkv = kp.shape[0] // ng
        bsz = rows // hkv

        def per_request(x: torch.Tensor, fill: float) -> torch.Tensor:  # group-major -> batch
            return x if c.identity else to_request_rows(x, c.place, fill)

        qg = qh.view(hkv, bsz, group, d)
        if not c.identity:  # batch -> group-major
            qg = qg.index_select(1, c.members)  # [Hkv, NG*M, G, D]
        shared = torch.bmm(qg.reshape(hkv * ng, m * group, d), kp.transpose(1, 2)).float()
        shared = shared.mul_(layer.scaling).view(hkv, ng, m * group, p).add_(c.mask)
        shared = shared.view(hkv, ng * m, group, p)
        top = shared.amax(-1, keepdim=True)  # [Hkv, NG*M, G, 1]
        weights = shared.sub_(top).exp_()
        total = weights.sum(-1, keepdim=True)
        out = torch.bmm(weights.to(qh.dtype).view(hkv * ng, m * group, p), vp).float()
        out = out.div_(total.view(hkv * ng, m * group, 1))  # [Hkv*NG, M*G, D]
        lse = per_request(top.add_(total.log_()), float("-inf")).view(rows, group, 1)
        pref = per_request(out.view(hkv, ng * m, group, d), 0.0).reshape(rows, group, d)
        own_lse = own_lse.view(rows, group, 1)
        joint = torch.logaddexp(own_lse, lse)
        own = own.float().mul_(own_lse.sub(joint).exp_())
        return own.add_(pref.mul_(lse.sub_(joint).exp_())).to(qh.dtype)
