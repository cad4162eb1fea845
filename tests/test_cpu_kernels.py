"""The compiled CPU kernels (spec_core/backends/cpu/cpu_kernels.py): each op against torch's, the runner's forward
through them against its torch path (prefill, decode, a tree), and which runners use them (never the fp32 reference)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from work_items import work_item

from spec_core.backends.cpu import cpu_kernels

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
    from spec_core.packing import pack
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

    item = functools.partial(work_item, ids)

    a, b = run([item(0, 40, 0), item(0, 36, 64)])
    assert torch.allclose(a, b, atol=1e-4)
    a, b = run([item(40, 1, 0), item(36, 5, 64, parents=(-1, -1, 0, 1))])  # a decode row and a tree row
    assert torch.allclose(a, b, atol=1e-4) and torch.equal(a.argmax(-1), b.argmax(-1))
    live = [s for s in range(caches[0].kv.shape[1]) if s != caches[0].scratch_slot]  # the kernels skip pads' K/V
    assert torch.allclose(caches[0].kv[:, live], caches[1].kv[:, live], atol=1e-5)


@pytest.mark.skipif(cpu_kernels.quant_gemm() is None, reason="the quantized matmuls need AVX2, FMA and F16C")
@pytest.mark.parametrize("weights", ["int4", "w8a8"])
def test_the_one_call_decoder_computes_the_op_by_op_floats(toy_pair, weights):
    """``decoder.c`` runs every layer in one call: a prefill, a decode row and a tree row give the op-by-op path's
    logits and K/V bit for bit, on one thread and on two."""
    from spec_core.backends.cpu import w8a8
    from spec_core.packing import WorkItem, pack
    from spec_core.runner import ModelRunner

    if weights == "w8a8" and not w8a8.w8a8_reduce_range():
        pytest.skip("w8a8 takes fbgemm on VNNI CPUs")
    runner = ModelRunner(toy_pair["target"], weights=weights)
    fused = runner.fused
    assert fused is not None and runner.batch_invariant
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, runner.vocab_size, (50,), generator=gen).tolist()
    items = [[WorkItem([], ids[:40], list(range(40)), list(range(40)), 40, [], list(range(40)))],
             [WorkItem(list(range(40)), ids[40:41], [40], [40], 1, [], [0])],
             [WorkItem(list(range(41)), ids[41:46], [41, 42, 42, 43, 43], list(range(41, 46)), 1, [0, 0, 1, 2],
                       list(range(5)))]]
    before = torch.get_num_threads()
    outs = []
    try:
        for runner.fused, threads in ((None, 1), (fused, 1), (fused, 2)):
            torch.set_num_threads(threads)
            cache = runner.new_paged_cache(8, 16)
            outs.append([runner.forward_paged(cache, pack(it, cache.scratch_slot)) for it in items] + [cache.kv])
    finally:
        torch.set_num_threads(before)
    for got in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, outs[0]))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_of_a_query_is_the_same_in_a_verify_a_step_and_a_long_chunk(dtype):
    """A query's attention output is bit for bit the same whether it runs alone (a decode step), among a verify's
    later, masked-off tokens, as a tree node with masked siblings in between, or past the first QUERY_CHUNK queries
    of a long forward (a prefill): the softmax sums its nonzero terms in their order only, and each query's
    arithmetic is its own. For fp32 and bf16 pools (head size 64: the vectorized passes where the CPU has them)."""
    k = cpu_kernels.load(dtype)
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, n = 4, 2, 64, 45  # 45 tokens: more than one chunk of 32 queries
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    cos, sin = torch.randn(64, d, generator=gen), torch.randn(64, d, generator=gen)
    pool = torch.zeros(n + 1, 2 * kv_heads, d, dtype=dtype)

    def attend(first, count):
        """Tokens [first, first + count) after a pool holding [0, first): their outputs, causal."""
        out = torch.empty(count, heads * d, dtype=dtype)
        kv_slots = torch.arange(first + count)[None]
        mask = kv_slots[:, None, :] <= torch.arange(first, first + count)[None, :, None]
        k.rope_store_attend(qkv[first:first + count].contiguous(), (cos, sin), torch.arange(first, first + count),
                            pool.data_ptr(), torch.arange(first, first + count), kv_slots, mask, out, heads,
                            kv_heads, d)
        return out

    whole = attend(0, n)  # one long forward, queries 32.. in the second chunk
    assert torch.equal(attend(40, 5), whole[40:])  # a verify of 5 over the same pool
    for i in (40, 41, 44):
        assert torch.equal(attend(i, 1), whole[i:i + 1])  # a one-token step
    # a tree node: its siblings' slots masked in between its ancestors' give what the ancestors alone give
    node = qkv[44:45].contiguous()
    seen = [s for s in range(45) if s not in (20, 33, 41)]
    outs = []
    for slots, mask in ((torch.arange(45)[None], torch.tensor([[[s in seen for s in range(45)]]])),
                        (torch.tensor([seen]), None)):
        out = torch.empty(1, heads * d, dtype=dtype)
        k.rope_store_attend(node, (cos, sin), torch.tensor([44]), pool.data_ptr(), torch.tensor([44]), slots, mask,
                            out, heads, kv_heads, d)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(cpu_kernels.load(torch.float32) is None, reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vectorized_attention_computes_the_generic_loops_floats(tmp_path, dtype):
    """Attention's passes vectorized across slots (AVX2) give the generic loops' floats bit for bit, for outputs
    and stored K/V, over fp32 and bf16 pools: head sizes on and off their path (64, 32, 128; 40 takes the loops),
    batches of rows with their own slots, random masks (tree siblings), and row lengths around the 8-slot and
    64-slot chunks. Bit for bit where the compiler vectorizes the generic score loop 8 lanes wide (AVX2); with
    AVX-512 it may pick 16 lanes, a different order of the same sums, so there the two agree to rounding (bf16
    outputs: to one rounding of their own)."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    generic = tmp_path / "generic.so"
    subprocess.run([cc, *cpu_kernels.FLAGS, "-DGENERIC_ATTENTION", "-o", str(generic),
                    str(cpu_kernels.SOURCES[0]), "-lm"], check=True)
    ref = cpu_kernels.DecodeKernels(ctypes.CDLL(str(generic)), dtype)
    k = cpu_kernels.load(dtype)
    eight_lanes = "avx512f" not in cpu_kernels._cpu_flags().split()
    gen = torch.Generator().manual_seed(7)
    for heads, kv_heads, d in ((9, 3, 64), (4, 2, 32), (8, 8, 128), (4, 1, 40)):
        for bsz, t, ctx in ((1, 1, 256), (2, 5, 7), (3, 4, 70), (1, 9, 0)):
            s = ctx + t
            qkv = torch.randn(bsz * t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
            cos, sin = torch.randn(s + 1, d, generator=gen), torch.randn(s + 1, d, generator=gen)
            pool = torch.randn(bsz * s + 1, 2 * kv_heads, d, generator=gen).to(dtype)
            kv_slots = torch.stack([torch.randperm(s, generator=gen) + b * s for b in range(bsz)])  # scattered
            write = kv_slots[:, ctx:].flatten().contiguous()
            pos = torch.arange(ctx, s).repeat(bsz)
            mask = torch.rand(bsz, t, s, generator=gen) < 0.7
            mask[..., 0] = True
            for m in (mask, None):
                outs, pools = [], []
                for kern in (k, ref):
                    out, got = torch.empty(bsz * t, heads * d, dtype=dtype), pool.clone()
                    kern.rope_store_attend(qkv, (cos, sin), pos, got.data_ptr(), write, kv_slots, m, out, heads,
                                           kv_heads, d)
                    outs.append(out)
                    pools.append(got)
                assert torch.equal(pools[0], pools[1]), (heads, d, bsz, t, ctx)
                if eight_lanes:
                    assert torch.equal(outs[0], outs[1]), (heads, d, bsz, t, ctx)
                elif dtype == torch.float32:
                    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6), (heads, d, bsz, t, ctx)
                else:  # the same sums in another order, each then rounded to bf16: at most one bf16 step apart
                    assert torch.allclose(outs[0].float(), outs[1].float(), rtol=2 ** -7, atol=1e-6), (heads, d)


def _w8a8_reference(x, w):
    """The compiled W8A8 matmul's contract in float64: each block of 32 of a row quantized with its own scale
    (rounding half to even), integer products, then the blocks' and the output channel's scales."""
    inp = w.in_features
    blocks = F.pad(x, (0, -inp % 32)).view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    xq = torch.round(blocks * torch.where(top > 0, 127 / top, 0)) * (top / 127)
    codes = w.packed.permute(0, 3, 1, 2, 4).reshape(w.packed.shape[0] * 8, -1)[: w.out_features]  # [out, in]
    return (xq.flatten(1).double() @ codes.double().t()) * w.scale[None, : w.out_features].double()


def _plain_c_kernels(tmp_path) -> cpu_kernels.QuantGemm:
    """The quantized matmuls built without SIMD (their plain-C forms), through ctypes."""
    import ctypes
    import shutil
    import subprocess

    out = tmp_path / "plain.so"
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-O2", "-march=x86-64", "-shared", "-fPIC", "-pthread", "-o", str(out),
                    str(cpu_kernels.SOURCES[1]), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.quant_simd.restype = ctypes.c_int
    assert lib.quant_simd() == 0
    return cpu_kernels.QuantGemm(lib)


@pytest.mark.skipif(cpu_kernels.quant_gemm() is None, reason="the quantized matmuls need AVX2, FMA and F16C")
def test_w8a8_kernel_matches_its_contract_is_batch_invariant_and_its_plain_c_form(tmp_path):
    from spec_core.backends.cpu.quant import RowW8A8Weight, dequantize, matmul, nbytes, pack_w8a8_rows, quantize_int8

    gen = torch.Generator().manual_seed(9)
    plain = _plain_c_kernels(tmp_path)
    for inp, out in ((96, 40), (100, 13), (576, 960)):  # sizes off the kernel's blocks of 32 inputs and 8 outputs too
        w_t = torch.randn(inp, out, generator=gen)
        w = pack_w8a8_rows(w_t, cpu_kernels.quant_gemm().w8a8)
        assert isinstance(w, RowW8A8Weight) and w.shape == (inp, out) and nbytes(w) == inp * out + out * 4
        assert torch.equal(w.scale[:out], quantize_int8(w_t).scale.float())
        x = torch.randn(6, inp, generator=gen)
        x[0, 3] = 50.0  # an outlier channel coarsens only its own block of 32
        got = matmul(x, w)
        ref = _w8a8_reference(x, w)
        assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
        dense = x @ dequantize(quantize_int8(w_t))
        err = (got - dense).abs().amax(1) / dense.abs().max()  # 8 bits per activation, scaled per block
        assert err[1:].max() < 0.005 and err[0] < 0.03
        loud = torch.cat([x[:1], x[1:] * 1000, torch.zeros(1, inp)])
        assert torch.equal(matmul(loud, w)[0], got[0]) and torch.equal(matmul(x[:1], w)[0], got[0])
        assert torch.equal(matmul(loud, w)[-1], torch.zeros(out))  # an all-zero row has scale 0, not NaN
        assert torch.equal(plain.w8a8(x, w), got)  # the plain-C form rounds as the AVX2 one does


def _q4_reference(x, w_t):
    """The compiled Q4_1 matmul's contract in float64: Q4_1 weights (d and m in fp16) times activations quantized
    per block of 32, as :func:`_w8a8_reference`."""
    from spec_core.backends.cpu.quant import _q4_1

    q, d, m = _q4_1(w_t.t().float())
    w = (q * d.half().double()[..., None] + m.half().double()[..., None]).flatten(1)  # [out, in]
    blocks = x.view(x.shape[0], -1, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    xq = torch.round(blocks * torch.where(top > 0, 127 / top, 0)) * (top / 127)
    return xq.flatten(1).double() @ w.t()


@pytest.mark.skipif(cpu_kernels.quant_gemm() is None, reason="the quantized matmuls need AVX2, FMA and F16C")
def test_q4_kernel_matches_its_contract_is_batch_invariant_and_its_plain_c_form(tmp_path):
    from spec_core.backends.cpu.quant import RowInt4Weight, matmul, nbytes, pack_q4_rows, quantize

    gen = torch.Generator().manual_seed(4)
    plain = _plain_c_kernels(tmp_path)
    for inp, out in ((64, 40), (96, 13), (576, 960)):
        w_t = torch.randn(inp, out, generator=gen)
        w = pack_q4_rows(w_t, cpu_kernels.quant_gemm().q4)
        assert isinstance(w, RowInt4Weight) and w.shape == (inp, out)
        assert nbytes(w) == -(-out // 8) * 8 * inp // 32 * 20  # Q4_1's 20 bytes per 32 weights (padded outputs)
        x = torch.randn(5, inp, generator=gen)
        got = matmul(x, w)
        ref = _q4_reference(x, w_t)
        assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
        loud = torch.cat([x[:1], x[1:] * 1000])
        assert torch.equal(matmul(loud, w)[0], got[0]) and torch.equal(matmul(x[:1], w)[0], got[0])
        assert torch.equal(plain.q4(x, w), got)
    # torch's int4 kernel (bf16 activations) on the same Q4_1 codes agrees to activation rounding
    torch_q4 = quantize(w_t, "int4")
    dense = matmul(x, torch_q4)
    assert (got - dense).abs().max() < 0.02 * dense.abs().max()


@pytest.mark.skipif(cpu_kernels.quant_gemm() is None, reason="the quantized matmuls need AVX2, FMA and F16C")
def test_quantized_matmuls_on_more_threads_give_the_same_floats():
    """The kernels split a call's outputs over torch's thread count; each output's arithmetic stays its own."""
    from spec_core.backends.cpu.quant import matmul, pack_q4_rows, pack_w8a8_rows

    gen = torch.Generator().manual_seed(2)
    kernels = cpu_kernels.quant_gemm()
    w_t = torch.randn(576, 1000, generator=gen)
    weights = (pack_w8a8_rows(w_t, kernels.w8a8), pack_q4_rows(w_t, kernels.q4))
    x = torch.randn(3, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        outs = {}
        for threads in (1, 2, 3, 1, 2):  # workers started, reused, and more of them than cores
            torch.set_num_threads(threads)
            outs.setdefault(threads, []).append([matmul(x, w) for w in weights])
    finally:
        torch.set_num_threads(before)
    ref = outs[1][0]
    for runs in outs.values():
        for got in runs:
            assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_torch_ops_on_one_thread_keeps_the_kernels_thread_count():
    """Inside the block torch runs on one thread and the compiled matmuls on torch's count from before; nesting
    changes nothing, and leaving restores torch's count."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with cpu_kernels.torch_ops_on_one_thread():
            assert (torch.get_num_threads(), cpu_kernels.gemm_threads()) == (1, 2)
            with cpu_kernels.torch_ops_on_one_thread():
                assert (torch.get_num_threads(), cpu_kernels.gemm_threads()) == (1, 2)
            assert (torch.get_num_threads(), cpu_kernels.gemm_threads()) == (1, 2)
        assert (torch.get_num_threads(), cpu_kernels.gemm_threads()) == (2, 2)
        torch.set_num_threads(1)
        with cpu_kernels.torch_ops_on_one_thread():
            assert (torch.get_num_threads(), cpu_kernels.gemm_threads()) == (1, 1)
    finally:
        torch.set_num_threads(before)
