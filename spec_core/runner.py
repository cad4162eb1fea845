"""The compact model runner: a Llama/Qwen-family decoder with a preallocated KV cache.

One ``forward`` call per step serves every mode (prefill, AR decode, SD verify, draft steps). The prefix is never
re-run: each call writes the K/V of its new tokens into cache slots and attends to the cached rows.

Cache addressing. The cache has ``max_rows`` independent rows of ``max_len`` slots. A token at sequence position
``pos`` normally lives in slot ``pos`` of its row, so rollback after a rejection is just a shorter valid length
(stale slots are overwritten by later writes). Callers that need other layouts (token trees) pass explicit
``slots`` and a boolean ``attn_mask``.

Exactness. Weights are loaded from the HF safetensors files and the math follows transformers' Llama/Qwen code
(RMSNorm in fp32, RoPE tables from transformers' own rotary module), so fp32 logits match within 1e-4. Runners off
that reference (bf16, int8, int4) take the fused RMSNorm of :mod:`spec_core.ops` and report their agreement.

Reduced output vocabulary. A draft folder may carry ``token_map.json``: the ascending full-vocabulary ids its head
covers (as EAGLE-3 and FR-Spec drafts do). The head then multiplies by those rows alone, and the logits come back
over the full vocabulary with ``-inf`` outside the map, so the proposal q is exactly zero there and every caller
(sampling, the q rows sent to the verifier) sees one full-vocabulary distribution.

Weight formats. ``weights="int8"`` or ``"int4"`` stores every weight matrix (and the LM head) in that weight-only
format (:mod:`spec_core.backends.cpu.quant`); the rest computes in ``dtype``. ``weights="w8a8"`` quantizes activations
too, after a calibration pass at load (:mod:`spec_core.backends.cpu.w8a8`). ``weights="gguf"``: a GGUF's own
matrices (:mod:`spec_core.backends.cpu.kquant`).

A ``.gguf`` path is converted once into an HF folder in the model cache (:func:`spec_core.model_paths.resolve_model`),
without fp32 weights where the runner reads the file's own blocks.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoConfig

from spec_core import gguf_weights
from spec_core.arch import ArchSpec, head_token_map
from spec_core.backends.cpu import cpu_kernels, kquant
from spec_core.backends.cpu.quant import (
    RowInt4Weight,
    RowW8A8Weight,
    Weight,
    matmul,
    nbytes,
    quantize,
)
from spec_core.backends.cpu.row_padding import MAX_ROWS, RowPadding, measure
from spec_core.kv_cache import KVCache, PagedBatch, PagedKVCache
from spec_core.model_paths import load_safetensors_dir, resolve_model
from spec_core.ops import RMSNorm, rope_, rope_tables, signed_sin
from spec_core.weight_layout import dense_layout

logger = logging.getLogger(__name__)

#: The LM head's format under a weight-only dtype, where it differs. int4 keeps an int8 head, as the GGUF does
#: (Q8_0 embeddings beside Q4_1 matrices): an int4 head moved the logits 5x further from fp32 (max 3.6 against
#: 0.7) to save 0.7 ms a token.
HEAD_FORMAT = {"int4": "int8"}


class Layer:
    """One decoder layer's weights (transposed), with q/k/v and gate/up fused for fewer kernel calls.

    Built from the host checkpoint ``w``, whose entries it consumes (pops); ``place`` moves a tensor to the device
    in the compute dtype, and each fused matrix is placed once finished, so the device never holds a layer twice;
    ``norm`` makes a norm weight an :class:`~spec_core.ops.RMSNorm`.
    """

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, spec: ArchSpec, place, norm) -> None:
        a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
        take = w.pop

        def dense(t: torch.Tensor | kquant.KQuantWeight):
            return t if isinstance(t, kquant.KQuantWeight) else dense_layout(place(t))

        def cat(*names: str) -> torch.Tensor | kquant.KQuantWeight:
            parts = [take(n) for n in names]
            return kquant.concat(parts) if isinstance(parts[0], kquant.KQuantWeight) else torch.cat(parts)

        self.qkv = dense(cat(f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"))
        self.qkv_bias = (
            place(torch.cat([take(f"{a}.q_proj.bias"), take(f"{a}.k_proj.bias"), take(f"{a}.v_proj.bias")]))
            if spec.qkv_bias else None
        )
        self.o = dense(take(f"{a}.o_proj.weight"))
        q_norm, k_norm = w.pop(f"{a}.q_norm.weight", None), w.pop(f"{a}.k_norm.weight", None)
        self.q_norm = norm(place(q_norm)) if q_norm is not None else None
        self.k_norm = norm(place(k_norm)) if k_norm is not None else None
        self.gate_up = dense(cat(f"{m}.gate_proj.weight", f"{m}.up_proj.weight"))
        self.down = dense(take(f"{m}.down_proj.weight"))
        self.ln_attn = norm(place(take(f"{prefix}.input_layernorm.weight")))
        self.ln_mlp = norm(place(take(f"{prefix}.post_attention_layernorm.weight")))

    def quantize(self, fmt: str, kernels=None) -> None:
        """Weight-only matrices in ``fmt``, for torch's kernels or the compiled ones (see :func:`quantize`)."""
        self.qkv, self.o = quantize(self.qkv, fmt, kernels), quantize(self.o, fmt, kernels)
        self.gate_up, self.down = quantize(self.gate_up, fmt, kernels), quantize(self.down, fmt, kernels)


#: The attention kernels SDPA may pick on a GPU: not cuDNN's, which builds an execution plan for every new shape (each
#: new context length, batch and tree width), so on an H200 a bf16 decode pass over lengths not seen before ran 45-73
#: ms per token against 17 ms warm. Flash and memory-efficient kernels need no per-shape build. (cuDNN's kernel takes
#: only half precision, so fp32, the exactness reference, picks the same kernel as before.)
GPU_ATTENTION_KERNELS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The scope of one forward's attention kernels on ``device`` (:data:`GPU_ATTENTION_KERNELS` on CUDA)."""
    return sdpa_kernel(list(GPU_ATTENTION_KERNELS)) if device.type == "cuda" else contextlib.nullcontext()


class ModelRunner:
    """Runs a decoder over a :class:`KVCache`. See the module docstring for the cache contract."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 weights: str | None = None, pad_rows: bool = True, kernels: bool = True,
                 reference: bool = True, token_map: torch.Tensor | None = None, cuda_graphs: bool = True) -> None:
        if weights not in (None, "int8", "int4", "w8a8", "gguf"):
            raise ValueError(f"unknown weight format {weights!r}")
        path = resolve_model(path, weights=weights != "gguf")
        self.weights = weights
        self.path = path
        self.hf_config = AutoConfig.from_pretrained(str(path))
        self.spec = ArchSpec.from_hf(self.hf_config)
        self.dtype, self.device = dtype, torch.device(device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"  # its backend's steps replay graphs
        # Layer by layer from the host checkpoint (fp32, or a GGUF's own blocks) to the device: a peak near the weights.
        self.token_map = head_token_map(path, self.spec.vocab_size, token_map)
        raw = (gguf_weights.runner_tensors(path, self.device, kernels, head_rows=self.token_map) if weights == "gguf"
               else load_safetensors_dir(path))

        def place(t):  # a tensor to the device in the compute dtype; a GGUF's own blocks stay as they are
            return t.to(device=self.device, dtype=dtype) if isinstance(t, torch.Tensor) else t

        self.embed = place(raw.pop("model.embed_tokens.weight"))
        self.lm_head = self._head(raw, place)
        #: Whether this runner is the exactness reference (dense fp32), whose every op is transformers' arithmetic
        #: bit for bit; other formats use the fused RMSNorm (:mod:`spec_core.ops`) and report their agreement. A
        #: draft passes ``reference=False``: its arithmetic never reaches the output (the verifier uses the q it
        #: drafted from), so an fp32 draft takes the CPU fast paths too.
        self.exact = reference and dtype == torch.float32 and weights is None
        cos, sin = self._rope_tables()
        self._cpu_fast_paths(pad_rows, kernels, (cos, sin))
        # int4 multiplies through the compiled Q4_1 x Q8 matmul where the CPU kernels run (int8 head: W8A8's)
        quant_kernels = cpu_kernels.quant_gemm() if weights == "int4" and self.kernels is not None else None
        if weights in ("int8", "int4"):
            self.lm_head = quantize(self.lm_head, HEAD_FORMAT.get(weights, weights), quant_kernels)

        def norm(weight: torch.Tensor) -> RMSNorm:
            return RMSNorm.build(weight, self.spec.rms_norm_eps, fused=not self.exact)

        self.norm = norm(place(raw.pop("model.norm.weight")))
        self.layers = []
        for i in range(self.spec.num_layers):
            layer = Layer(raw, f"model.layers.{i}", self.spec, place, norm)
            if weights in ("int8", "int4"):
                layer.quantize(weights, quant_kernels)
            self.layers.append(layer)
        del raw
        self.cos, self.sin_signed = cos.to(dtype), signed_sin(sin).to(dtype)
        #: CPU attention over bf16/fp16 K/V runs in fp32: torch's half-precision CPU attention kernel is several
        #: times slower for decode rows (200 us against 45 us per layer here), and fp32 is the more exact of the two.
        self.attention_in_fp32 = self.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        self.q_size = self.spec.num_heads * self.spec.head_dim
        self.kv_size = self.spec.num_kv_heads * self.spec.head_dim
        if weights == "w8a8":
            self._convert_w8a8()
        #: Whether a forward computes each token's logits independently of the other rows and tokens it carries
        #: (every matrix the compiled kernels', and their attention for forwards of any length): SD and SSD then
        #: equal this runner's own AR token for token, as they equal transformers' in fp32.
        self.batch_invariant = self.kernels is not None and all(
            isinstance(m, (RowW8A8Weight, RowInt4Weight, kquant.KQuantWeight)) for m in self.weight_matrices())
        #: Every layer in one compiled call per forward (:class:`cpu_kernels.FusedDecoder`), where it applies.
        self.fused = cpu_kernels.fused_decoder(self)

    def kernel_threads(self) -> contextlib.AbstractContextManager:
        """Where every matmul is the compiled kernels' (:attr:`batch_invariant`), torch's ops run on one thread
        inside the block and the kernels on torch's thread count (:func:`cpu_kernels.torch_ops_on_one_thread`);
        elsewhere nothing changes. The engine holds it over a step's forward and verification."""
        return cpu_kernels.torch_ops_on_one_thread() if self.batch_invariant else contextlib.nullcontext()

    def _head(self, raw: dict, place) -> Weight:
        """The LM head (the embedding where tied), cut to the token map where there is one (a GGUF's own blocks are
        cut as they are read: :func:`gguf_weights.runner_tensors`)."""
        head_raw = raw.pop("lm_head.weight", None)
        head = self.embed if self.spec.tie_embeddings or head_raw is None else head_raw
        if self.token_map is not None:
            self.token_map = self.token_map.to(self.device)
        if isinstance(head, kquant.QuantEmbedding):  # a tied head in the GGUF's own blocks
            return head.as_matrix(self.token_map)
        if isinstance(head, kquant.KQuantWeight):
            return head
        head = head if head is self.embed else place(head)
        if self.token_map is not None:
            head = head[self.token_map]
        return dense_layout(head)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids`` (any shape), ``[*ids.shape, hidden]`` in the compute dtype."""
        if isinstance(self.embed, kquant.QuantEmbedding):
            return self.embed.lookup(ids)
        return F.embedding(ids, self.embed)

    def _cpu_fast_paths(self, pad_rows: bool, kernels: bool, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Row padding and the compiled small ops: CPU runners other than the fp32 exactness reference, unless
        turned off (``rope``: the fp32 RoPE tables the kernels read)."""
        cpu_fast = self.device.type == "cpu" and not self.exact
        #: Whether forwards are padded to the row count the weight matmuls run fastest at
        #: (:mod:`spec_core.backends.cpu.row_padding`).
        self.pad_rows = pad_rows and cpu_fast
        #: The measured padding by torch thread count (the fastest row count differs between 1 and 2 threads).
        self.row_paddings: dict[int, RowPadding] = {}
        #: The compiled small ops (:mod:`spec_core.backends.cpu.cpu_kernels`) for models without q/k norms, and their
        #: RoPE tables.
        self.kernels = cpu_kernels.load(self.dtype) if kernels and cpu_fast and not self.spec.qk_norm else None
        self.rope_f32 = tuple(t.contiguous() for t in rope) if self.kernels else None

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin for every position (transformers' arithmetic, :func:`spec_core.ops.rope_tables`), fp32
        on this runner's device."""
        cos, sin = rope_tables(self.hf_config, self.spec.max_positions)
        return cos.to(self.device), sin.to(self.device)

    def _convert_w8a8(self) -> None:
        """``--dtype w8a8``: int8 weights and activations, SmoothQuant-calibrated on the model's own text."""
        from transformers import AutoTokenizer

        from spec_core.backends.cpu import w8a8

        if not any((self.path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"dtype w8a8 calibrates on the model's own text, and {self.path} has no tokenizer "
                             "(for a draft, --draft-dtype auto keeps it in float)")
        w8a8.convert(self, w8a8.calibration_ids(AutoTokenizer.from_pretrained(str(self.path))), gemm=w8a8.row_gemm(self))

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    def row_padding(self) -> RowPadding | None:
        """The row padding for torch's current thread count, measured on its first use (about a second), or None
        where this runner does not pad."""
        if not self.pad_rows:
            return None
        threads = torch.get_num_threads()
        pad = self.row_paddings.get(threads)
        if pad is None:
            pad = self.row_paddings[threads] = measure(self.weight_matrices(), self.dtype, self.device)
            logger.info("%s, %d thread(s): rows padded %s (matmul stack at 1..%d rows: %s ms)", self.path.name,
                        threads, pad.padded_sizes() or "never", MAX_ROWS,
                        [round(t * 1e3, 1) for t in pad.seconds])
        return pad

    def weight_matrices(self) -> list[Weight]:
        """Every weight matrix one decode step multiplies by (``[in, out]``), in order: what a token must read."""
        mats = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return mats + [self.lm_head]

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: the matrices, the norms and one embedding row."""
        norms = [n.weight for n in [self.norm] + [n for layer in self.layers for n in (layer.ln_attn, layer.ln_mlp)]]
        row = self.embed.row_nbytes if isinstance(self.embed, kquant.QuantEmbedding) else nbytes(self.embed[0])
        return sum(nbytes(t) for t in self.weight_matrices() + norms) + row

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(self.spec, num_blocks, block_size, self.dtype, self.device)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim * torch.finfo(self.dtype).bits // 8

    def new_cache(self, max_rows: int, max_len: int) -> KVCache:
        if max_len > self.spec.max_positions:
            max_len = self.spec.max_positions
        return KVCache(self.spec, max_rows, max_len, self.dtype, self.device)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor | None = None,
        kv_len: int | None = None,
        slots: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run new tokens through the model, writing their K/V into the cache.

        Args:
            input_ids: ``[B, T]`` new tokens.
            positions: ``[B, T]`` their sequence positions (RoPE).
            rows: ``[B]`` cache rows (default ``arange(B)``).
            kv_len: slots ``[0, kv_len)`` of each row are attended (default ``max(slots) + 1``).
            slots: ``[B, T]`` cache slots to write (default = ``positions``).
            attn_mask: ``[B, T, kv_len]`` bool, True = may attend. Default: slot s is visible to a query at
                position p iff ``s <= p`` (causal for position-addressed rows).
            logits_index: ``[B, T']`` indices into T of the rows whose logits are wanted (default: all).
        Returns:
            logits ``[B, T', V]`` in fp32.
        """
        bsz, t = input_ids.shape
        contiguous_rows = rows is None
        rows = torch.arange(bsz, device=self.device) if rows is None else rows
        slots = positions if slots is None else slots
        if kv_len is None:
            kv_len = int(slots.max()) + 1
        if attn_mask is None and not (t == 1 and bool((slots[:, 0] == kv_len - 1).all())):
            attn_mask = torch.arange(kv_len, device=self.device)[None, None, :] <= positions[:, :, None]
        row_idx = rows[:, None].expand(bsz, t)

        def store(li: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            hkv = kv.shape[2] // 2
            cache.k[li][row_idx, :, slots] = kv[:, :, :hkv]
            cache.v[li][row_idx, :, slots] = kv[:, :, hkv:]
            if contiguous_rows:
                keys, values = cache.k[li][:bsz, :, :kv_len], cache.v[li][:bsz, :, :kv_len]
            else:
                keys, values = cache.k[li][rows, :, :kv_len], cache.v[li][rows, :, :kv_len]
            return self._for_attention(keys), self._for_attention(values)

        with attention_kernels(self.device):
            return self._run(input_ids, positions, store, attn_mask, logits_index)

    @torch.inference_mode()
    def forward_paged(self, cache: PagedKVCache, batch: PagedBatch) -> torch.Tensor:
        """Run a packed ragged batch over a paged cache (see :class:`PagedBatch`). Returns fp32 logits."""
        bsz, t = batch.input_ids.shape
        if self.kernels is not None and (t <= cpu_kernels.MAX_TOKENS_PER_ROW or self.batch_invariant):
            with self.kernel_threads():
                return self._logits(cpu_kernels.run_paged(self, cache, batch), batch.logits_index)
        write = batch.write_slots.reshape(-1)
        flat_kv = batch.kv_slots.reshape(-1)

        def store(li: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pool, heads = cache.kv[li], kv.shape[2:]
            pool.index_copy_(0, write, kv.reshape(bsz * t, *heads))
            gathered = self._for_attention(pool.index_select(0, flat_kv))  # index_select: 3x a gather
            return gathered.view(bsz, -1, *heads).transpose(1, 2).split(heads[0] // 2, dim=1)

        with attention_kernels(self.device):
            return self._run(batch.input_ids, batch.positions, store, batch.attn_mask, batch.logits_index)

    def _for_attention(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the dtype attention runs in (see ``attention_in_fp32``)."""
        return x.float() if self.attention_in_fp32 else x

    def _run(self, input_ids, positions, store, attn_mask, logits_index) -> torch.Tensor:
        """The decoder stack. ``store(layer, kv)`` writes the new tokens' K/V (``kv [B, T, 2 * kv_heads, D]``, the
        K heads then the V heads) and returns the keys and values to attend, ``[B, kv_heads, S, D]`` each, in the
        attention dtype."""
        bsz, t = input_ids.shape
        spec = self.spec
        heads, kv_heads = spec.num_heads, spec.num_kv_heads
        mask4 = attn_mask[:, None] if attn_mask is not None else None
        cos, sin = self.cos[positions][:, :, None], self.sin_signed[positions][:, :, None]  # [B, T, 1, D]
        h = self.embed_tokens(input_ids)
        for li, layer in enumerate(self.layers):
            qkv = matmul(layer.ln_attn(h), layer.qkv, layer.qkv_bias).view(bsz, t, -1, spec.head_dim)
            if layer.q_norm is not None:
                q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
                qkv = torch.cat((layer.q_norm(q), layer.k_norm(k), v), 2)
            rope_(qkv[:, :, : heads + kv_heads], cos, sin)  # q and k heads, one pass, in place
            keys, values = store(li, qkv[:, :, heads:])
            q = qkv[:, :, :heads].transpose(1, 2).to(keys.dtype)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask4, enable_gqa=True)
            h.add_(matmul(attn.to(h.dtype).transpose(1, 2).reshape(bsz, t, self.q_size), layer.o))
            gate, up = matmul(layer.ln_mlp(h), layer.gate_up).chunk(2, dim=-1)
            h.add_(matmul(F.silu(gate, inplace=True) * up, layer.down))
        return self._logits(h, logits_index)

    def _logits(self, h: torch.Tensor, logits_index: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits of the final hidden states ``h [B, T, hidden]`` (the rows of ``logits_index``)."""
        if logits_index is not None:
            h = torch.gather(h, 1, logits_index[:, :, None].expand(-1, -1, h.shape[-1]))
        h = self.norm(h)
        logits = matmul(h, self.lm_head).float()
        if self.token_map is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.spec.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.token_map, logits)
