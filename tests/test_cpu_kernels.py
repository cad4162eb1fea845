"""The compiled CPU kernels (spec_core/cpu_kernels.py): each op against torch's, the runner's forward through them
against its torch path (prefill, decode, a tree), and which runners use them (never the fp32 reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spec_core import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load(torch.float32) is None, reason="no C compiler on this machine")


def _attention_reference(qkv, cos, sin, pos, pool, write, kv_slots, mask, heads, kv_heads, d):
    """The layer's RoPE, K/V store and attention in plain torch fp32 (the kernel's contract)."""
    n = qkv.shape[0]
    x = qkv.float().view(n, heads + 2 * kv_heads, d)

    def rope(t):
        half = d // 2
        rot = torch.cat((-t[..., half:], t[..., :half]), -1)
        return t * cos[pos][:, None] + rot * sin[pos][:, None]

    q, k, v = rope(x[:, :heads]), rope(x[:, heads: heads + kv_heads]), x[:, heads + kv_heads:]
    pool = pool.clone()
    pool[write] = torch.cat((k, v), 1).to(pool.dtype)
    bsz, s = kv_slots.shape
    t = n // bsz
    keys = pool[kv_slots].float()  # [B, S, 2 KVH, D]
    out = []
    for b in range(bsz):
        kk = keys[b, :, :kv_heads].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [H, S, D]
        vv = keys[b, :, kv_heads:].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        qq = q[b * t:(b + 1) * t].transpose(0, 1)  # [H, T, D]
        m = None if mask is None else mask[b][None]
        out.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=m).transpose(0, 1).reshape(t, -1))
    return torch.cat(out), pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_matches_torch(dtype):
    k = cpu_kernels.load(dtype)
    gen = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    x, w = torch.randn(3, 96, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float())
    assert torch.allclose(k.rms_norm(x, w, 1e-5).float(), ref, atol=tol, rtol=tol)
    gu = torch.randn(2, 5, 64, generator=gen).to(dtype)
    ref = F.silu(gu[..., :32].float()) * gu[..., 32:].float()
    assert torch.allclose(k.silu_mul(gu).float(), ref, atol=tol, rtol=tol)

    heads, kv_heads, d, bsz, t, slots = 6, 2, 16, 2, 3, 40
    qkv = torch.randn(bsz * t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    cos, sin = torch.randn(64, d, generator=gen), torch.randn(64, d, generator=gen)
    pos = torch.randint(0, 64, (bsz * t,), generator=gen)
    pool = torch.randn(slots + 1, 2 * kv_heads, d, generator=gen).to(dtype)
    write = torch.tensor([10, 11, 12, 30, 31, 32])
    kv_slots = torch.tensor([list(range(0, 13)), list(range(20, 33))])
    mask = torch.rand(bsz, t, 13, generator=gen) < 0.6
    mask[..., 0] = True  # every query sees a slot
    for m in (mask, None):
        out = torch.empty(bsz * t, heads * d, dtype=dtype)
        got_pool = pool.clone()
        k.rope_store_attend(qkv, (cos, sin), pos, got_pool.data_ptr(), write, kv_slots, m, out, heads, kv_heads, d)
        ref_out, ref_pool = _attention_reference(qkv, cos, sin, pos, pool, write, kv_slots, m, heads, kv_heads, d)
        pool_tol = 1e-5 if dtype == torch.float32 else 5e-2
        assert torch.allclose(got_pool.float(), ref_pool.float(), atol=pool_tol, rtol=pool_tol)
        assert torch.allclose(out.float(), ref_out, atol=1e-4 if dtype == torch.float32 else 5e-2, rtol=tol)


def test_runner_forward_through_the_kernels_matches_its_torch_path(toy_pair):
    """A prefill (torch's path, past MAX_TOKENS_PER_ROW), two decode rows and a tree row through the kernels give
    the torch path's logits (fp32 arithmetic, so within float error) and the same K/V."""
    from spec_core.packing import WorkItem, pack
    from spec_core.runner import ModelRunner

    fast = ModelRunner(toy_pair["target"])
    assert fast.kernels is None  # the fp32 reference never takes them: here they are put in by hand
    fast.kernels = cpu_kernels.load(torch.float32)
    fast.rope_f32 = fast._rope_tables()
    ref = ModelRunner(toy_pair["target"])
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.vocab_size, (60,), generator=gen).tolist()
    caches = [r.new_paged_cache(16, 8) for r in (fast, ref)]

    def run(items):
        return [r.forward_paged(c, pack(items, c.scratch_slot)) for r, c in zip((fast, ref), caches)]

    def item(start, n, slot0, parents=()):
        pending = n - len(parents)
        depth = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        pos = list(range(start, start + pending)) + [start + pending - 1 + dd for dd in depth]
        return WorkItem(prefix_slots=list(range(slot0, slot0 + start)), token_ids=ids[start:start + n], positions=pos,
                        write_slots=list(range(slot0 + start, slot0 + start + n)), num_pending=pending,
                        parents=list(parents), logits_rows=list(range(n)))

    a, b = run([item(0, 40, 0), item(0, 36, 64)])
    assert torch.allclose(a, b, atol=1e-4)
    a, b = run([item(40, 1, 0), item(36, 5, 64, parents=(-1, -1, 0, 1))])  # a decode row and a tree row
    assert torch.allclose(a, b, atol=1e-4) and torch.equal(a.argmax(-1), b.argmax(-1))
    assert torch.allclose(caches[0].kv, caches[1].kv, atol=1e-5)


def test_which_runners_use_the_kernels(toy_pair):
    from spec_core.runner import ModelRunner

    assert ModelRunner(toy_pair["target"]).kernels is None  # the exactness reference
    assert ModelRunner(toy_pair["target"], dtype=torch.bfloat16).kernels is not None
    assert ModelRunner(toy_pair["target"], weights="int8").kernels is not None
    assert ModelRunner(toy_pair["target"], dtype=torch.bfloat16, kernels=False).kernels is None


def test_the_build_is_cached_by_source_flags_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path))
    path = cpu_kernels.build()
    assert path.parent == tmp_path / "kernels" and path.is_file()
    mtime = path.stat().st_mtime_ns
    assert cpu_kernels.build() == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags : another cpu")
    assert cpu_kernels.library_path() != path
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="C compiler"):
        cpu_kernels.build()
