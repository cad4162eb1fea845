"""The runner's small ops: RoPE in place is transformers' arithmetic bit for bit, the fused RMSNorm is closer to
fp32 than the cast-then-scale form in bf16 and never used by the fp32 reference, and a mask that hides nothing is
left out of a packed batch."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from spec_core.kv_cache import PagedKVCache
from spec_core.ops import RMSNorm, fused_rms_norm, rms_norm, rope_, signed_sin
from spec_core.packing import WorkItem, pack
from spec_core.runner import ModelRunner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_is_transformers_rotation_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 9, 64, generator=gen).to(dtype)  # [B, T, H, D]
    k = torch.randn(2, 5, 3, 64, generator=gen).to(dtype)
    angles = torch.rand(2, 5, 32, generator=gen) * 100
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # transformers' [B, H, T, D]
    qk = torch.cat((q, k), 2)
    rope_(qk, cos[:, :, None], signed_sin(sin)[:, :, None])
    assert torch.equal(qk[:, :, :9], ref_q.transpose(1, 2)) and torch.equal(qk[:, :, 9:], ref_k.transpose(1, 2))


def test_fused_rms_norm_is_closer_to_fp32_than_the_exact_form_in_bf16():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 7, 576, generator=gen) * 3).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    ref = rms_norm(x.float(), w.float(), 1e-5)
    exact, fused = rms_norm(x, w, 1e-5), fused_rms_norm(x, torch.cat((w, w)), 1e-5)
    assert fused.dtype == torch.bfloat16 and fused.is_contiguous() and fused.shape == x.shape
    fused_err, exact_err = (fused.float() - ref).abs().max(), (exact.float() - ref).abs().max()
    assert fused_err <= exact_err and fused_err < 0.03
    # in fp32 the fused form agrees to rounding, but is not the reference's arithmetic
    f32 = fused_rms_norm(x.float(), torch.cat((w, w)).float(), 1e-5)
    assert (f32 - ref).abs().max() < 1e-5


def test_only_the_fp32_reference_uses_the_exact_norm(tiny_models):
    fp32 = ModelRunner(tiny_models["llama"])
    bf16 = ModelRunner(tiny_models["llama"], dtype=torch.bfloat16)
    int8 = ModelRunner(tiny_models["llama"], weights="int8")
    norms = lambda r: [r.norm] + [n for layer in r.layers for n in (layer.ln_attn, layer.ln_mlp)]  # noqa: E731
    assert fp32.exact and all(n.doubled is None for n in norms(fp32))
    assert not bf16.exact and all(isinstance(n, RMSNorm) and n.doubled is not None for n in norms(bf16))
    assert not int8.exact and all(n.doubled is not None for n in norms(int8))


def test_an_fp32_draft_takes_the_fast_paths_and_the_target_stays_the_reference(tiny_models):
    """A draft's arithmetic never reaches the output (the verifier uses the q it drafted from), so an fp32 draft
    loads with ``reference=False``: fused norms, row padding and the compiled small ops, where they build. The fp32
    target stays transformers' arithmetic; SD over that pair still equals AR token for token."""
    from spec_core.backends.cpu import cpu_kernels
    from spec_core.config import ModelConfig, SamplingParams
    from spec_core.models import LoadedPair, load_runner
    from spec_core.sequence import Sequence
    from verifier_service.api import Generator, run_one

    target = load_runner(ModelConfig(str(tiny_models["llama"]), dtype="float32"))
    draft = load_runner(ModelConfig(str(tiny_models["llama-noisy"]), dtype="float32"), reference=False)
    norms = lambda r: [r.norm] + [n for layer in r.layers for n in (layer.ln_attn, layer.ln_mlp)]  # noqa: E731
    assert target.exact and target.kernels is None and not target.pad_rows
    assert not draft.exact and draft.pad_rows and all(n.doubled is not None for n in norms(draft))
    assert (draft.kernels is not None) == (cpu_kernels.load(torch.float32) is not None)
    fixed = Generator.from_pair(LoadedPair(target, draft, None, ()), k=3)
    planned = Generator.from_pair(fixed.pair, k=3, adaptive=True)  # SD's K from measured costs, as ssd serve plans
    assert fixed.engine("sd", 3).adaptive is None and planned.engine("sd", 3).adaptive.k_max == 3
    assert planned.engine("ar", 0).adaptive is None
    outs, stats = {}, {}
    for name, gen, mode, k in (("ar", fixed, "ar", 0), ("sd", fixed, "sd", 3), ("sd-planned", planned, "sd", 3)):
        seqs = [Sequence(str(i), p, SamplingParams(max_new_tokens=24, ignore_eos=True))
                for i, p in enumerate(([5, 17, 42, 9], [100, 3, 77]))]
        outs[name] = [s.output_ids for s in seqs if run_one(gen.engine(mode, k), s)]
        stats[name] = [s.stats for s in seqs]
    assert outs["sd"] == outs["ar"] == outs["sd-planned"] and all(len(o) == 24 for o in outs["ar"])
    assert sum(s.num_accepted for s in stats["sd"]) > 0  # the noisy draft agrees often: the drafts were used


def test_pack_leaves_out_a_mask_that_hides_nothing(tiny_models):
    runner = ModelRunner(tiny_models["llama"])
    cache = PagedKVCache(runner.spec, 4, 4, torch.float32, torch.device("cpu"))
    decode = [WorkItem([0, 1, 2], [5], [3], [3], 1, [], [0]), WorkItem([4, 5, 6], [6], [3], [7], 1, [], [0])]
    assert pack(decode, cache.scratch_slot).attn_mask is None
    ragged = [decode[0], WorkItem([4, 5], [6], [2], [6], 1, [], [0])]  # the shorter row's pad slot is hidden
    verify = [WorkItem([0, 1, 2], [5, 6], [3, 4], [3, 4], 2, [], [0, 1])]  # causal among the new tokens
    assert pack(ragged, cache.scratch_slot).attn_mask is not None
    assert pack(verify, cache.scratch_slot).attn_mask is not None
    # and a decode step gives the same logits with the mask left out as with it spelled out
    prefix = [WorkItem([], [3, 4, 5], [0, 1, 2], [0, 1, 2], 3, [], [2])]
    runner.forward_paged(cache, pack(prefix, cache.scratch_slot))
    step = pack(decode[:1], cache.scratch_slot)
    spelled = pack(decode[:1], cache.scratch_slot)
    spelled.attn_mask = torch.ones(1, 1, 4, dtype=torch.bool)
    assert torch.equal(runner.forward_paged(cache, step), runner.forward_paged(cache, spelled))
