"""Requests on one cached prefix: finding them in a batch, and attending extends together.

The radix cache hands requests that share a prompt prefix (a system prompt, few-shot examples,
a fork's parent) the same KV slots for it, so a batch's shared prefixes show in its slot
tables. `find_groups` finds them in a decode batch (`shared_runs` does the matching); the CPU
attention backend decodes such groups with cascade attention (each prefix read once per step),
as does the fused decode step, and extends them together (`extend_groups`,
`attend_extend_group`): all members' new tokens attend to the shared prefix in one flash
attention call (ArborLM's `prefix_attention` kernel where it runs) and to their own keys in one
more, padded, the two parts merged by their log-sum-exps (both kernels return them).
`cascade_meta` turns a decode batch's groups into the tensors its cascade attention indexes by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from arborlm.runtime.attention.base import AttentionLayerSpec
from arborlm.runtime.attention.torch_native import head_rows
from arborlm.runtime.forward_batch import ForwardBatch
from arborlm.runtime.platforms.cpu import kernels as cpu_kernels
from arborlm.runtime.platforms.cpu.decode_workspace import Layout

# Requests of a decode batch form a cascade group when they share at least this many cached
# tokens (below it, the extra matmuls cost more than the duplicated reads save) ...
CASCADE_MIN_PREFIX = 64
# ... and the batch decodes through its groups when that reads at least this fraction of its
# keys fewer times (else one dense batch is cheaper: fewer, larger kernels).
CASCADE_MIN_SAVING = 0.25
# Most new tokens of a request that extends in a cascade group: members' own parts are padded
# to the longest, and a long extend is dominated by its own keys anyway (it attends alone).
CASCADE_EXTEND_MAX_NEW = 256


def shares_a_prefix(batch: ForwardBatch) -> bool:
    """Whether two requests of the batch hold the same KV slot at the position from which
    `find_groups` would group them (a shared cached prefix: cascade decode reads it once for
    the group; a step without cascade attention would read it once per request)."""
    at = CASCADE_MIN_PREFIX - 1
    rows = [r for r, n in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu) if n > at + 1]
    if len(rows) < 2:
        return False
    slots = batch.req_to_token_pool.req_to_token[rows, at].tolist()
    return len(set(slots)) < len(slots)


def find_groups(slots: torch.Tensor, lens: list[int]) -> Layout:
    """Cascade groups of a decode batch (`slots` `[B, L]`, padding 0): requests holding the
    same slot at position `CASCADE_MIN_PREFIX - 1` share the radix-cache path up to it, so
    they form a group whose prefix is their longest common run of slots. Groups are used when
    reading each prefix once saves at least `CASCADE_MIN_SAVING` of the batch's keys."""
    layout = Layout([0] * len(lens), [-1] * len(lens))
    eligible = [i for i, n in enumerate(lens) if n > CASCADE_MIN_PREFIX]
    if len(eligible) < 2:
        return layout
    saved = 0
    caps = [n - 1 for n in lens]  # a request's newest key is its own
    for group, shared in shared_runs(slots, eligible, caps, CASCADE_MIN_PREFIX):
        for i in group:
            layout.offsets[i], layout.groups[i] = shared, layout.num_groups
        layout.num_groups += 1
        layout.prefix_width = max(layout.prefix_width, shared)
        saved += (len(group) - 1) * shared
    if saved < CASCADE_MIN_SAVING * sum(lens):
        return Layout([0] * len(lens), [-1] * len(lens))
    return layout


def shared_runs(slots: torch.Tensor, candidates: list[int], caps: list[int],
                min_prefix: int) -> list[tuple[list[int], int]]:
    """Groups among `candidates` (rows of `slots` `[B, L]`) that hold the same slot at position
    `min_prefix - 1`, i.e. share the radix-cache path up to it: `(members, shared)` for each
    group of two or more whose common run of slots, capped at its members' smallest `caps`
    (indexed like the rows), reaches `min_prefix`."""
    members: dict[int, list[int]] = {}
    for i, key in zip(candidates, slots[candidates, min_prefix - 1].tolist()):
        members.setdefault(key, []).append(i)
    runs = []
    for group in members.values():
        if len(group) < 2:
            continue
        rows = slots[group]  # [m, L]
        shared = int((rows == rows[:1]).all(dim=0).cumprod(dim=0).sum())
        shared = min(shared, min(caps[i] for i in group))
        if shared >= min_prefix:
            runs.append((group, shared))
    return runs


def causal_mask(prefix: int, ext: int, first: int, device) -> torch.Tensor:
    """`[ext, prefix + ext - first]` bool: new token t (position prefix + t) attends to the
    positions first.. up to its own."""
    q_pos = torch.arange(prefix, prefix + ext, device=device)[:, None]
    return torch.arange(first, prefix + ext, device=device)[None, :] <= q_pos


@dataclass
class ExtendGroup:
    """Requests of an extend batch on the same cached prefix: it is read once for all of them.
    The members' new tokens are laid out padded, `[M, E]` (E = the most new tokens of one)."""

    slots: torch.Tensor  # [P] the shared prefix's KV slots
    tokens: torch.Tensor  # [M * E] batch row of each padded position (padding: the last)
    own_slots: torch.Tensor  # [M * L] KV slots after the shared prefix, new ones included
    # (L = the most of one member; padding: slot 0)
    own_mask: torch.Tensor  # [M, E, L] bool: True where a new token attends to an own key
    # (padding rows repeat the member's last real row)
    real: torch.Tensor  # [N] padded positions that are real tokens, in batch order
    members: list[int]  # batch indices
    max_new: int  # E
    max_own: int  # L
    float_masks: dict = field(default_factory=dict)  # dtype -> own_mask as 0 / -inf `[M,1,E,L]`


def extend_groups(table: torch.Tensor, rows: list[int], slots: list[torch.Tensor | None],
                  starts: list[int], prefixes: list[int], min_prefix: int,
                  max_new: int) -> list[ExtendGroup]:
    """The cascade groups of an extend batch: requests of at most `max_new` new tokens on at
    least `min_prefix` shared cached slots. `rows` are their `req_to_token` rows, `slots`
    each one's slots up to its last new token, `starts` the first row of each one's new
    tokens (and the total)."""
    exts = [b - a for a, b in zip(starts, starts[1:])]
    eligible = [i for i, (p, e) in enumerate(zip(prefixes, exts))
                if p >= min_prefix and e <= max_new]
    if len(eligible) < 2:
        return []
    table_rows = table[rows, :max(prefixes[i] for i in eligible)]  # [B, P]
    runs = shared_runs(table_rows, eligible, prefixes, min_prefix)
    return [_layout(members, shared, slots, starts, prefixes, table.device)
            for members, shared in runs]


def _layout(members: list[int], shared: int, slots: list[torch.Tensor | None],
            starts: list[int], prefixes: list[int], device) -> ExtendGroup:
    """The padded layout of one cascade extend group (see `ExtendGroup`)."""
    exts = [starts[i + 1] - starts[i] for i in members]
    owns = [slots[i][shared:] for i in members]  # the rest of the prefix, then the new tokens
    e, width = max(exts), max(len(o) for o in owns)
    tokens, own_slots, real = [], [], []
    mask = torch.zeros((len(members), e, width), dtype=torch.bool, device=device)
    for j, (i, ext, own) in enumerate(zip(members, exts, owns)):
        tokens.extend(starts[i] + min(t, ext - 1) for t in range(e))
        real.extend(j * e + t for t in range(ext))
        own_slots.append(F.pad(own, (0, width - len(own))))
        mask[j, :ext, :len(own)] = causal_mask(prefixes[i], ext, shared, device)
        mask[j, ext:] = mask[j, ext - 1]  # padding rows: as the last real one (never all -inf)
    return ExtendGroup(slots=slots[members[0]][:shared],
                       tokens=torch.tensor(tokens, device=device),
                       own_slots=torch.cat(own_slots), own_mask=mask,
                       real=torch.tensor(real, device=device), members=members, max_new=e,
                       max_own=width)


def attend_extend_group(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                        layer: AttentionLayerSpec, g: ExtendGroup, out: torch.Tensor,
                        kernel: bool = False) -> None:
    """All members' new queries (rows of q `[T, H, D]`) attend to the shared prefix in one
    flash attention call (the prefix's K/V read once, not once per member), and to their own
    keys (the rest of each prefix and the new tokens, causally) in one more over the members,
    padded; the two parts merge by their log-sum-exps, as one softmax over both would. Writes
    the members' `out` rows. CPU only (ATen's CPU flash kernel gives the log-sum-exps).

    With `kernel` (ArborLM's attention kernels take the pool's dtype and head shape), the
    shared part is `cpu_kernels.prefix_attention`, which reads the prefix straight from the
    pool (no gather, no copy of each KV head per query head)."""
    hkv, d, h = layer.num_kv_heads, layer.head_dim, layer.num_heads
    group = h // hkv
    m, e, width = len(g.members), g.max_new, g.max_own

    def heads(x: torch.Tensor) -> torch.Tensor:  # [..., Hkv, D] -> [..., H, D]
        return x.to(q.dtype) if group == 1 else x.to(q.dtype).repeat_interleave(group, -2)

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    qs = q.index_select(0, g.tokens)  # padded [M*E, H, D]
    if kernel:
        n = g.real.numel()
        shared, shared_lse = cpu_kernels.prefix_attention(
            qs.index_select(0, g.real), k_buf, v_buf, g.slots.view(1, -1).contiguous(),
            torch.tensor([g.slots.numel()]), torch.zeros(n, dtype=torch.int64),
            layer.scaling)  # [N, H, D] float32, [N, H]
    else:
        kp = heads(k_buf.index_select(0, g.slots)).transpose(0, 1)[None]  # [1, H, P, D]
        vp = heads(v_buf.index_select(0, g.slots)).transpose(0, 1)[None]
        real = qs.index_select(0, g.real).transpose(0, 1)[None]  # [1, H, N, D]
        shared, shared_lse = flash(real, kp, vp, 0.0, False, scale=layer.scaling)
        shared, shared_lse = shared[0].transpose(0, 1).float(), shared_lse[0].transpose(0, 1)
    ko = heads(k_buf.index_select(0, g.own_slots)).view(m, width, h, d).transpose(1, 2)
    vo = heads(v_buf.index_select(0, g.own_slots)).view(m, width, h, d).transpose(1, 2)
    mask = g.float_masks.get(q.dtype)
    if mask is None:  # built by the first layer, for all
        mask = torch.zeros(g.own_mask.shape, dtype=q.dtype, device=q.device)
        mask = g.float_masks[q.dtype] = mask.masked_fill_(~g.own_mask, float("-inf"))[:, None]
    own, own_lse = flash(qs.view(m, e, h, d).transpose(1, 2), ko, vo, 0.0, False,
                         attn_mask=mask, scale=layer.scaling)  # [M, H, E, D], [M, H, E]
    own = own.transpose(1, 2).reshape(m * e, h, d).index_select(0, g.real).float()
    own_lse = own_lse.transpose(1, 2).reshape(m * e, h).index_select(0, g.real)[..., None]
    shared_lse = shared_lse[..., None]  # [N, H, 1]
    joint = torch.logaddexp(shared_lse, own_lse)
    res = shared.mul_(shared_lse.sub(joint).exp_())
    res.add_(own.mul_(own_lse.sub_(joint).exp_()))
    out.index_copy_(0, g.tokens.index_select(0, g.real), res.to(out.dtype))


@dataclass
class CascadeMeta:
    """Cascade groups of a decode batch: requests sharing a cached prefix, read once a group."""

    index: torch.Tensor | None  # [Hkv * NG * P] pool rows of each group's prefix (padded), or
    # None when the prefixes are in the workspace
    mask: torch.Tensor  # [1, NG, 1, P] float32: 0 within a group's prefix, -inf past it
    members: torch.Tensor  # [NG * M] batch index of each group's members (padding: 0)
    place: torch.Tensor  # [B] each request's row among the NG * M (NG * M: in no group)
    num_groups: int  # NG
    max_members: int  # M
    width: int  # P: the longest group prefix
    identity: bool = False  # every request in a group, groups in batch order and equal-sized:
    # group-major rows are the batch's own rows (no reordering needed)


def to_request_rows(x: torch.Tensor, place: torch.Tensor, fill: float) -> torch.Tensor:
    """Group-major rows `[Hkv, NG*M, ...]` -> per-request rows `[Hkv, B, ...]` (`place[i]`
    is request i's row; `NG*M`, one past the last, gives a row of `fill`)."""
    pad = x.new_full((x.shape[0], 1, *x.shape[2:]), fill)
    return torch.cat([x, pad], dim=1).index_select(1, place)


def cascade_meta(slots: torch.Tensor | None, layout: Layout, hkv: int) -> CascadeMeta | None:
    """The group tensors of `layout` (None without groups); with `slots` `[B, L]`, also the
    pool rows of each group's prefix (a continuing step reads them from the workspace)."""
    if not any(g >= 0 for g in layout.groups):
        return None
    ng, p = layout.num_groups, layout.prefix_width
    by_group: list[list[int]] = [[] for _ in range(ng)]
    for i, g in enumerate(layout.groups):
        if g >= 0:
            by_group[g].append(i)
    m = max(map(len, by_group))
    members, place = [0] * (ng * m), [ng * m] * len(layout.groups)
    for g, group in enumerate(by_group):
        for j, i in enumerate(group):
            members[g * m + j], place[i] = i, g * m + j
    lens = [layout.offsets[group[0]] if group else 0 for group in by_group]
    device = slots.device if slots is not None else None
    valid = torch.arange(p, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    mask = torch.zeros((1, ng, 1, p), dtype=torch.float32, device=device)
    mask.masked_fill_(~valid[None, :, None, :], float("-inf"))
    index = None
    if slots is not None:
        first = torch.tensor([group[0] if group else 0 for group in by_group], device=device)
        index = head_rows(slots[first, :p] * valid, hkv)  # [Hkv * NG * P]
    identity = members == place == list(range(len(layout.groups)))
    return CascadeMeta(index=index, mask=mask, members=torch.tensor(members, device=device),
                        place=torch.tensor(place, device=device), num_groups=ng,
                        max_members=m, width=p, identity=identity)
