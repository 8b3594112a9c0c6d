"""`torch_native` attention: plain PyTorch over the paged KV pool. The reference backend.

Runs on CPU and GPU and is what CI uses. The layouts are chosen for CPU speed:

- Extend attends request by request with `scaled_dot_product_attention`. A request with no
  cached prefix attends to its own new K/V straight from the projection (no read of the pool);
  one on a prefix gathers its slots once per layer.
- Decode gathers every request's keys into one padded batch, laid out KV-head-major
  (`[Hkv * B, L, D]`), with a single `index_select` on the pool viewed as rows of one head;
  attention is then two batched matmuls with exactly the model's FLOPs (each KV head's group of
  query heads against its own keys) and a float32 softmax. (SDPA's CPU flash kernel costs
  ~0.1 ms a call even for one short query, more than these few small kernels.)
- Consecutive decode steps of the same requests keep the padded batch in a `DecodeWorkspace`
  and append each step's new token to it, instead of gathering the whole history again. The
  backend is therefore stateful: one instance serves one model runner (as the registry makes).
- Cascade decode: when every request of a decode batch shares a cached prefix (the radix cache
  gives them the same slots), that prefix's K/V is read once for the whole batch instead of once
  per request, and its scores join each request's own scores in one softmax.

Not here: sliding windows, custom masks, CUDA graphs (the gather is sized by host lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from arborlm.runtime.attention.base import AttentionBackend, AttentionLayerSpec
from arborlm.runtime.attention.decode_workspace import DecodeWorkspace
from arborlm.runtime.forward_batch import ForwardBatch

# A decode batch shares its prefix through the cascade path when the shared part is at least
# this many tokens (below it, the extra matmuls cost more than the duplicated reads save).
CASCADE_MIN_PREFIX = 64


@dataclass
class _DecodeMeta:
    index: torch.Tensor | None  # [Hkv * B * L] int64 rows of the pool seen as [slots * Hkv, D]
    mask: torch.Tensor  # [1, B, 1, L] float32: 0 for real keys, -inf for padding
    width: int  # L: own (non-shared) keys per request, padded
    prefix_index: torch.Tensor | None  # [Hkv * P] rows of the shared prefix (cascade), or None
    prefix_len: int  # P
    workspace: str | None = None  # "fill" (copy the gather in) / "append" (no gather) / None
    # (head, request, position) of each request's new token in the workspace, for "append".
    append_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class _ExtendMeta:
    slots: list[torch.Tensor | None]  # per request: [seq_len] KV slots, None without a prefix
    masks: list[torch.Tensor | None]  # per request: [ext, seq_len] bool (True = attend) or None


def _padding_mask(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """`[1, B, 1, width]` float32: 0 for positions below each request's length, else -inf."""
    pos = torch.arange(width, device=seq_lens.device)
    mask = torch.zeros((1, seq_lens.shape[0], 1, width), dtype=torch.float32, device=pos.device)
    return mask.masked_fill_(pos >= seq_lens[:, None, None], float("-inf"))


def _head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Slots `[...]` -> rows `[Hkv * ...]` of a `[num_slots * Hkv, D]` view, head-major."""
    heads = torch.arange(num_kv_heads, device=slots.device).view(-1, *([1] * slots.dim()))
    return (slots.unsqueeze(0) * num_kv_heads + heads).flatten()


class TorchNativeBackend(AttentionBackend):
    def __init__(self) -> None:
        self.workspace = DecodeWorkspace()

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

    @staticmethod
    def _extend_metadata(batch: ForwardBatch) -> _ExtendMeta:
        table = batch.req_to_token_pool.req_to_token
        slots: list[torch.Tensor | None] = []
        masks: list[torch.Tensor | None] = []
        rows = batch.req_pool_indices.tolist()
        for row, prefix, ext in zip(rows, batch.extend_prefix_lens_cpu,
                                    batch.extend_seq_lens_cpu):
            if prefix == 0:
                slots.append(None)  # plain causal over its own new tokens
                masks.append(None)
                continue
            seq = prefix + ext
            slots.append(table[row, :seq])
            q_pos = torch.arange(prefix, seq, device=table.device)[:, None]
            masks.append(torch.arange(seq, device=table.device)[None, :] <= q_pos)  # [ext, seq]
        return _ExtendMeta(slots=slots, masks=masks)

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
        meta: _ExtendMeta = batch.attn_metadata
        k_buf = batch.kv_pool.k_buffer[layer.layer_id]
        v_buf = batch.kv_pool.v_buffer[layer.layer_id]
        gqa = layer.num_heads != layer.num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for ext, slots, mask in zip(batch.extend_seq_lens_cpu, meta.slots, meta.masks):
            end = start + ext
            if slots is None:
                ki, vi = k[start:end], v[start:end]  # [ext, Hkv, D]
            else:
                ki, vi = k_buf.index_select(0, slots), v_buf.index_select(0, slots)  # [S,Hkv,D]
            oi = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),  # [1, H, ext, D]
                ki.transpose(0, 1).unsqueeze(0).to(q.dtype),  # [1, Hkv, S, D]
                vi.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=mask, is_causal=mask is None, scale=layer.scaling, enable_gqa=gqa,
            )  # [1, H, ext, D]
            out[start:end] = oi[0].transpose(0, 1)
            start = end
        return out

    # --- decode -------------------------------------------------------------------------------

    def _decode_metadata(self, batch: ForwardBatch) -> _DecodeMeta:
        ws = self.workspace
        if ws.continues(batch):
            heads = torch.arange(batch.kv_pool.num_kv_heads, device=batch.seq_lens.device)
            index = (heads[:, None], torch.arange(batch.batch_size, device=heads.device)[None, :],
                     (batch.seq_lens - 1)[None, :])  # [Hkv, 1], [1, B], [1, B]
            width = self._workspace_width(batch)
            return _DecodeMeta(index=None, mask=_padding_mask(batch.seq_lens, width),
                               width=width, prefix_index=None, prefix_len=0,
                               workspace="append", append_index=index)
        meta = self._gather_metadata(batch)
        if meta.prefix_index is None and ws.prepare(batch):
            meta.workspace = "fill"
            width = self._workspace_width(batch)
            if width != meta.width:
                meta.mask, meta.width = _padding_mask(batch.seq_lens, width), width
        return meta

    def _workspace_width(self, batch: ForwardBatch) -> int:
        """Keys attended per request from the workspace. float32: the longest sequence (the
        strided view is fastest); half precision: the whole capacity, as its batched matmuls
        are ~1.6x faster on a contiguous operand than on the strided one, padding and all."""
        if batch.kv_pool.dtype == torch.float32:
            return max(batch.seq_lens_cpu)
        return self.workspace.capacity

    @staticmethod
    def _gather_metadata(batch: ForwardBatch) -> _DecodeMeta:
        """Metadata to gather every request's keys from the pool (with cascade detection)."""
        hkv = batch.kv_pool.num_kv_heads
        width = max(batch.seq_lens_cpu)
        table = batch.req_to_token_pool.req_to_token
        if batch.batch_size == 1:  # no padding, no sharing: a slice of the request's row
            slots = table[int(batch.req_pool_indices[0]), :width]  # [L]
            mask = torch.zeros((1, 1, 1, width), dtype=torch.float32, device=slots.device)
            return _DecodeMeta(index=_head_rows(slots, hkv), mask=mask, width=width,
                               prefix_index=None, prefix_len=0)
        slots = table[batch.req_pool_indices, :width]  # [B, L]
        pos = torch.arange(width, device=slots.device)
        valid = pos[None, :] < batch.seq_lens[:, None]  # [B, L]
        slots = slots * valid  # padding -> slot 0
        prefix_len = 0
        if min(batch.seq_lens_cpu) > CASCADE_MIN_PREFIX:
            same = (slots == slots[:1]).all(dim=0)  # [L]; a request's own token never matches
            prefix_len = int(same.cumprod(dim=0).sum())
        prefix_index = None
        if prefix_len >= CASCADE_MIN_PREFIX:
            prefix_index = _head_rows(slots[0, :prefix_len], hkv)
            slots, valid = slots[:, prefix_len:], valid[:, prefix_len:]
        else:
            prefix_len = 0
        mask = torch.zeros(valid.shape, dtype=torch.float32, device=slots.device)
        mask.masked_fill_(~valid, float("-inf"))
        return _DecodeMeta(index=_head_rows(slots, hkv), mask=mask[None, :, None, :],
                           width=width - prefix_len, prefix_index=prefix_index,
                           prefix_len=prefix_len)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayerSpec,
                       batch: ForwardBatch) -> torch.Tensor:
        """The interface's form: the new tokens' K/V are read back from the pool."""
        loc = batch.out_cache_loc
        return self._decode(q, batch.kv_pool.k_buffer[layer.layer_id][loc],
                            batch.kv_pool.v_buffer[layer.layer_id][loc], layer, batch)

    def _keys(self, k_new: torch.Tensor, v_new: torch.Tensor, layer: AttentionLayerSpec,
              batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's padded keys and values, `[Hkv * B, L, D]` each."""
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

    def _decode(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                layer: AttentionLayerSpec, batch: ForwardBatch) -> torch.Tensor:
        """q `[B, H, D]`, the new tokens' k/v `[B, Hkv, D]` (already in the pool) -> `[B, H, D]`."""
        meta: _DecodeMeta = batch.attn_metadata
        bsz, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        group = layer.num_heads // hkv
        k, v = self._keys(k_new, v_new, layer, batch)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qh = q.view(bsz, hkv, group, d).transpose(0, 1).reshape(hkv * bsz, group, d)
        scores = torch.bmm(qh, k.transpose(1, 2)).float()  # [Hkv * B, G, L]
        scores = scores.view(hkv, bsz, group, meta.width).mul_(layer.scaling).add_(meta.mask)
        if meta.prefix_index is None:
            probs = torch.softmax(scores, dim=-1).to(q.dtype)  # [Hkv, B, G, L]
            out = torch.bmm(probs.view(hkv * bsz, group, meta.width), v)  # [Hkv * B, G, D]
        else:
            k_rows = batch.kv_pool.k_buffer[layer.layer_id].view(-1, d)  # [slots * Hkv, D]
            v_rows = batch.kv_pool.v_buffer[layer.layer_id].view(-1, d)
            out = self._cascade(qh, scores, v, k_rows, v_rows, meta, layer)
        return out.view(hkv, bsz, group, d).transpose(0, 1).reshape(bsz, layer.num_heads, d)

    @staticmethod
    def _cascade(qh: torch.Tensor, scores: torch.Tensor, v: torch.Tensor, k_rows: torch.Tensor,
                 v_rows: torch.Tensor, meta: _DecodeMeta,
                 layer: AttentionLayerSpec) -> torch.Tensor:
        """Decode attention over (shared prefix, own keys): `[Hkv * B, G, D]`.

        `scores` `[Hkv, B, G, L]` are the own keys' scaled, masked scores. The prefix's K/V is
        read once; each KV head's queries of all requests attend to it in one matmul.
        """
        hkv, bsz, group, width = scores.shape
        d, p = qh.shape[-1], meta.prefix_len
        kp = k_rows.index_select(0, meta.prefix_index).view(hkv, p, d).to(qh.dtype)
        vp = v_rows.index_select(0, meta.prefix_index).view(hkv, p, d).to(qh.dtype)
        shared = torch.bmm(qh.view(hkv, bsz * group, d), kp.transpose(1, 2)).float()
        shared = shared.mul_(layer.scaling).view(hkv, bsz, group, p)  # [Hkv, B, G, P]
        probs = torch.softmax(torch.cat([shared, scores], dim=-1), dim=-1).to(qh.dtype)
        out = torch.bmm(probs[..., :p].reshape(hkv, bsz * group, p), vp)  # [Hkv, B*G, D]
        own = torch.bmm(probs[..., p:].reshape(hkv * bsz, group, width), v)  # [Hkv*B, G, D]
        return own.add_(out.view(hkv * bsz, group, d))
