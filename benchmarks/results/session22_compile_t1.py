"""Session 22: could torch.compile bring bf16 T(1) within 1.2x of its matmuls (#13)? Measured, not shipped.

    python benchmarks/results/session22_compile_t1.py static     # one fixed decode shape, gpt-fast style
    python benchmarks/results/session22_compile_t1.py dynamic    # the runner's own paged forward, dynamic shapes

``static``: the target's decode step written as a plain ``nn.Module`` (bf16 ``nn.Linear``-layout weights, a
contiguous K/V cache, B = 1, T = 1, 257 keys), eager and compiled by inductor with freezing and weight prepacking.
``dynamic``: ``ModelRunner._run`` through the paged store, dense bf16 weights, ``torch.compile(dynamic=True)``, at
1, 2, 5 and 9 new tokens. One thread. Prints step times and compile times.
"""

from __future__ import annotations

import sys
import time

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from spec_core.model_paths import default_pair
from spec_core.packing import WorkItem, forward_items, pack
from spec_core.quant import LinearWeight, PackedLinear
from spec_core.runner import ModelRunner


def _median_ms(fn, n: int = 50) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


class StaticDecode(torch.nn.Module):
    """The target's decode step for one token, from a float32 runner's weights (stored ``[in, out]``)."""

    def __init__(self, r: ModelRunner) -> None:
        super().__init__()
        bf = torch.bfloat16

        def param(w: torch.Tensor) -> torch.nn.Parameter:
            return torch.nn.Parameter(w.t().contiguous().to(bf), requires_grad=False)

        self.spec = r.spec
        self.mats = torch.nn.ParameterList(param(m) for layer in r.layers
                                           for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.head = param(r.lm_head)
        self.norms = [(la.ln_attn.weight.to(bf), la.ln_mlp.weight.to(bf)) for la in r.layers]
        self.final, self.emb = r.norm.weight.to(bf), r.embed.to(bf)
        self.cos, self.sin = r.cos.to(bf), r.sin_signed.to(bf)

    def forward(self, ids, pos, kc, vc, kv_len: int):
        h_, kv_, d = self.spec.num_heads, self.spec.num_kv_heads, self.spec.head_dim
        h = F.embedding(ids, self.emb)
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        for i, (ln1, ln2) in enumerate(self.norms):
            qkv_w, o_w, gu_w, dn_w = self.mats[4 * i: 4 * i + 4]
            qkv = F.linear(F.rms_norm(h, (h.shape[-1],), ln1, 1e-5), qkv_w).view(1, 1, h_ + 2 * kv_, d)
            qk = qkv[:, :, : h_ + kv_]
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            kc[i].index_copy_(2, pos[0], qk[:, :, h_:].transpose(1, 2))
            vc[i].index_copy_(2, pos[0], qkv[:, :, h_ + kv_:].transpose(1, 2))
            a = F.scaled_dot_product_attention(qk[:, :, :h_].transpose(1, 2).float(), kc[i][:, :, :kv_len].float(),
                                               vc[i][:, :, :kv_len].float(), enable_gqa=True)
            h = h + F.linear(a.to(h.dtype).transpose(1, 2).reshape(1, 1, -1), o_w)
            g, u = F.linear(F.rms_norm(h, (h.shape[-1],), ln2, 1e-5), gu_w).chunk(2, -1)
            h = h + F.linear(F.silu(g) * u, dn_w)
        return F.linear(F.rms_norm(h, (h.shape[-1],), self.final, 1e-5), self.head).float()


def static() -> None:
    r = ModelRunner(default_pair()["target"], dtype=torch.float32)
    net = StaticDecode(r)
    s = r.spec
    kc = [torch.zeros(1, s.num_kv_heads, 300, s.head_dim, dtype=torch.bfloat16) for _ in range(s.num_layers)]
    vc = [torch.zeros_like(k) for k in kc]
    ids, pos = torch.tensor([[5]]), torch.tensor([[256]])
    print(f"static eager (F.linear, no prepack): {_median_ms(lambda: net(ids, pos, kc, vc, 257)):.2f} ms")
    inductor_config.freezing = True
    inductor_config.cpp.weight_prepack = True
    compiled = torch.compile(net, dynamic=False)
    t0 = time.time()
    with torch.inference_mode():
        compiled(ids, pos, kc, vc, 257)
    print(f"static compile: {time.time() - t0:.1f} s; compiled T(1): "
          f"{_median_ms(lambda: compiled(ids, pos, kc, vc, 257)):.2f} ms")


class PagedStack(torch.nn.Module):
    """``ModelRunner._run`` through the paged store, with the runner's weights registered as buffers."""

    def __init__(self, r: ModelRunner) -> None:
        super().__init__()
        self.r = r
        for i, layer in enumerate(r.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                self.register_buffer(f"w{i}_{name}", getattr(layer, name).w)
        self.register_buffer("head", r.lm_head.w)

    def forward(self, input_ids, positions, write, flat_kv, attn_mask, logits_index, pool):
        r, (bsz, t) = self.r, input_ids.shape

        def store(li, kv):
            heads = kv.shape[2:]
            pool[li].index_copy_(0, write, kv.reshape(bsz * t, *heads))
            gathered = r._for_attention(pool[li].index_select(0, flat_kv))
            return gathered.view(bsz, -1, *heads).transpose(1, 2).split(heads[0] // 2, dim=1)

        return r._run(input_ids, positions, store, attn_mask, logits_index)


def dynamic() -> None:
    inductor_config.freezing = True
    r = ModelRunner(default_pair()["target"], dtype=torch.bfloat16)

    def unpack(w):
        return LinearWeight(w.dense()) if isinstance(w, PackedLinear) else w

    for la in r.layers:
        la.qkv, la.o, la.gate_up, la.down = unpack(la.qkv), unpack(la.o), unpack(la.gate_up), unpack(la.down)
    r.lm_head = unpack(r.lm_head)
    stack = PagedStack(r)
    compiled = torch.compile(stack, dynamic=True)
    context, block = 256, 16
    cache = r.new_paged_cache(-(-(context + 10) // block), block)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, r.vocab_size, (context,), generator=gen).tolist()
    forward_items(r, cache, [WorkItem([], prompt, list(range(context)), list(range(context)), context, [],
                                      [context - 1])])
    for n in (1, 2, 5, 9):
        new = torch.randint(0, r.vocab_size, (n,), generator=gen).tolist()
        span = list(range(context, context + n))
        b = pack([WorkItem(list(range(context)), new, span, span, n, [], list(range(n)))], cache.scratch_slot)
        args = (b.input_ids, b.positions, b.write_slots.reshape(-1), b.kv_slots.reshape(-1), b.attn_mask,
                b.logits_index, cache.kv)
        t0 = time.time()
        with torch.inference_mode():
            compiled(*args)
        first = time.time() - t0
        print(f"dynamic T({n}): first call {first:.1f} s, then {_median_ms(lambda a=args: compiled(*a), 20):.2f} ms "
              f"(eager, dense weights: {_median_ms(lambda a=args: stack(*a), 20):.2f} ms)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"static": static, "dynamic": dynamic}[sys.argv[1]]()
