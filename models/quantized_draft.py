"""The target at 4 bits as its own draft (quantised self-speculation), on the target's KV cache.

SmolLM2's shipped GGUF stores every layer matrix as Q4_1 codes; the fp32 target is those codes
dequantised. Run through ATen's bfloat16 int4 kernel (``models.q4``), the same model drafts a
token in 0.3 of a target step at one thread, and agrees with the target's greedy token ~99% of
the time (SmolLM2 on the bench HumanEval prompts' greedy continuations: 1,267 of 1,280
positions): only the bfloat16 rounding of activations and scales differs. No training, no
second model.

Why it is cheap: at batch 1 a target step is mostly streaming its fp32 weights (~540 MB, ~45
ms a step here), while the int4 kernel gets through the 4-bit layer weights in ~7 ms; the rest
is kept lean: one fused kernel call for q/k/v and one for gate/up per layer, one token per call,
the residual stream in fp32, matmul inputs in bf16, the layer loop under TorchScript.

The LM head (SmolLM2's is its Q8_0 embedding table, 28M weights) at 4 bits costs ~1.6 ms but
alone would cut agreement to 92.3% (its top two tokens are often close); so the head's top
``shortlist`` tokens are rescored exactly with the target's own fp32 rows, which restores the
target's ranking whenever its best token is among them (top 8: 99.0% agreement, as with the
fp32 head).

The cache: the target's committed K/V are what the draft would have computed, up to rounding,
so the draft reads them and writes its own K/V for the drafted tokens just past each row's
committed length, where nothing reads them once the draft is done: the target's next pass
writes its pending entries over them (``StaticKVCache``: positions past a row's length are
stale). The draft owns no cache and commits nothing.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from genrec_spec.kernels.q4_matmul import load as load_q4_matmul
from genrec_spec.models.kv_cache import StaticKVCache
from genrec_spec.models.llama import Llama
from genrec_spec.models.q4 import Q4Codes, Q4Weight, cat_codes, quantize_q4

# Token candidates of the 4-bit LM head rescored with the target's fp32 head rows.
SHORTLIST = 8


def _layer_loop(
    x: Tensor,  # [B, dim] fp32 the residual stream
    rotation: Tensor,  # [B, D, D] fp32 RoPE at each row's position, as a matrix (_rotation)
    k_cache: Tensor,  # [n_layers, B, Hkv, S, D] the target's
    v_cache: Tensor,  # [n_layers, B, Hkv, S, D]
    rows: Tensor,  # [B] int64 0 .. B - 1
    positions: Tensor,  # [B] int64 where each row's token sits
    visible: Tensor | None,  # [B, 1, 1, span] bool: keys a row may read; None: all
    span: int,  # keys read: positions.max() + 1
    weights: list[Tensor],  # per layer, qkv, wo, gate_up, down: Q4Weight's codes, scales, mins
    norms: list[Tensor],  # per layer: attention_norm, ffn_norm weights [dim]
    sizes: list[int],  # Hq, Hkv, D, dim, hidden
    eps: float,
) -> Tensor:  # [B, dim] the last layer's output
    """Every layer for one token per row, writing its K/V into the cache at ``positions``.
    TorchScript runs it (``_scripted_layer_loop``): at batch 1 the Python interpreter's cost per
    op is a seventh of a draft step here (SmolLM2: 15.8 ms a step eager, 13.7 ms scripted)."""
    hq, hkv, hd, dim, hidden = sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]
    batch, n_qkv = x.shape[0], (hq + 2 * hkv) * hd
    # narrow, not x[:, a:b]: TorchScript emits one slice per dimension of an index expression.
    for i in range(len(norms) // 2):
        qkv = _matmul(x, weights, 4 * i, norms[2 * i], eps)  # the attention norm, fused
        qkv = qkv.narrow(1, 0, n_qkv).view(batch, hq + 2 * hkv, hd)
        qk = torch.bmm(qkv.narrow(1, 0, hq + hkv), rotation)  # [B, Hq + Hkv, D]: q, k at once
        k_cache[i][rows, :, positions] = qk.narrow(1, hq, hkv).to(k_cache.dtype)
        v_cache[i][rows, :, positions] = qkv.narrow(1, hq + hkv, hkv).to(v_cache.dtype)
        out = F.scaled_dot_product_attention(
            qk.narrow(1, 0, hq).unsqueeze(2).to(k_cache.dtype),  # [B, Hq, 1, D]
            k_cache[i].narrow(2, 0, span),
            v_cache[i].narrow(2, 0, span),
            attn_mask=visible,
            enable_gqa=True,
        )  # [B, Hq, 1, D]
        x = x + _matmul(out.reshape(batch, hq * hd), weights, 4 * i + 1, None, 0.0).narrow(
            1, 0, dim
        )
        gate_up = _matmul(x, weights, 4 * i + 2, norms[2 * i + 1], eps)  # the FFN norm, fused
        h = F.silu(gate_up.narrow(1, 0, hidden)) * gate_up.narrow(1, hidden, hidden)
        x = x + _matmul(h, weights, 4 * i + 3, None, 0.0).narrow(1, 0, dim)
    return x


def _matmul(
    x: Tensor,  # [B, K] fp32
    weights: list[Tensor],
    j: int,
    norm: Tensor | None,  # [K]: RMS-normalise x with this weight first
    eps: float,
) -> Tensor:  # [B, N'] fp32, N' = N padded to a multiple of 16
    """Matrix j of ``weights``: Q4Weight's codes, scales and mins at 3 j .. 3 j + 2."""
    codes, scales, mins = weights[3 * j], weights[3 * j + 1], weights[3 * j + 2]
    return torch.ops.genrec_spec.q4_matmul(x, codes, scales, mins, norm, eps)


def _rotation(
    cos: Tensor,  # [B, D] fp32 from llama.rope_tables: [cos, cos]
    sin: Tensor,  # [B, D] fp32: [-sin, sin]
) -> Tensor:  # [B, D, D]
    """Rotate-half RoPE (``llama.apply_rope``: x * cos + roll(x, D / 2) * sin) as the matrix R
    with x @ R the same rotation: one product per layer for q and k instead of five ops.
    R[i, j] = cos[j] if i == j, sin[j] if i == (j + D / 2) mod D."""
    half = cos.shape[-1] // 2
    return torch.diag_embed(cos) + torch.diag_embed(sin).roll(half, dims=-2)


@functools.cache
def _scripted_layer_loop():
    """``_layer_loop`` compiled by TorchScript, once per process. TorchScript is deprecated in
    favour of torch.compile, which here took 94 s to compile SmolLM2's loop and ran it slower
    (18 ms against 15 eager); the deprecation warning is expected and silenced. A torch that
    can no longer script it runs the same loop eagerly, ~15% slower, and says so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return torch.jit.script(_layer_loop)
        except Exception as err:  # TorchScript removed or unable to compile: same loop, eager
            failure = err
    warnings.warn(
        f"TorchScript could not compile the quantised draft's layer loop ({failure!r}); it runs "
        "eagerly, about 15% slower a draft step",
        RuntimeWarning,
        stacklevel=2,
    )
    return _layer_loop


class QuantizedDraft:
    """A 4-bit copy of a native ``Llama``'s layers and LM head that scores one token per row
    per call on the target's own cache (``step``)."""

    def __init__(
        self, target: Llama, codes: dict[str, Q4Codes] | None = None, shortlist: int = SHORTLIST
    ) -> None:
        """codes: 4-bit codes per parameter name of ``target`` (``read_gguf_q4``: exactly the
        weights a GGUF target was dequantised from); any matrix not given is rounded from the
        target's own weights (``quantize_q4``), so ``codes=None`` quantises a target loaded from
        any checkpoint. The matrices' input sizes (dim, heads x head size, hidden) must be
        multiples of 32, the kernel's group."""
        codes = codes or {}
        for name, c in codes.items():
            if c.codes.shape != target.get_parameter(name).shape:
                raise ValueError(
                    f"4-bit codes of shape {tuple(c.codes.shape)} for {name}, whose weight is "
                    f"{tuple(target.get_parameter(name).shape)}: the codes are of another model; "
                    "pass the codes of the target's own checkpoint, or none to quantise it"
                )
        self.target = target
        self.config = target.config
        self.shortlist = shortlist

        def q4(*names: str) -> Q4Weight:
            return cat_codes(
                [codes.get(n) or quantize_q4(target.get_parameter(n)) for n in names]
            ).pack()

        load_q4_matmul()  # the op must be registered before TorchScript compiles the loop
        self.weights, self.norms = [], []  # _layer_loop's lists
        for i, block in enumerate(target.layers):
            p = f"layers.{i}."
            for weight in (
                q4(*(f"{p}attention.{w}.weight" for w in ("wq", "wk", "wv"))),
                q4(f"{p}attention.wo.weight"),
                q4(f"{p}feed_forward.w1.weight", f"{p}feed_forward.w3.weight"),
                q4(f"{p}feed_forward.w2.weight"),
            ):
                self.weights += [weight.codes, weight.scales, weight.mins]
            self.norms += [block.attention_norm.weight.detach(), block.ffn_norm.weight.detach()]
        head = "tok_embeddings.weight" if target.output is None else "output.weight"
        self.head = q4(head)
        self.head_rows = target.get_parameter(head).detach()  # [V, dim] exact, for the shortlist

    @classmethod
    def from_gguf(cls, target: Llama, path: str | Path, shortlist: int = SHORTLIST):
        """The draft of a target loaded from the GGUF file ``path`` (``Llama.from_gguf``): its
        Q4_0 / Q4_1 matrices as stored; the rest (e.g. a Q8_0 LM head) rounded to 4 bits."""
        from genrec_spec.models.llama_loading import read_gguf_config, read_gguf_q4

        if read_gguf_config(path) != target.config:
            raise ValueError(
                f"{path} holds another model than this target ({target.config}); build the "
                "draft from the target's own GGUF file, or QuantizedDraft(target) to quantise it"
            )
        return cls(target, read_gguf_q4(path), shortlist)

    def relative_cost(self, batch_size: int = 1) -> float:
        """A draft step's time relative to a target step at this batch size, one thread, as
        measured for SmolLM2 on this project's 2-core CPU: 13.7 / 49 ms at batch 1, 44.6 / 72.9
        ms at batch 8 (the int4 kernel's cost grows with rows, ~3.3x at 8, where the fp32
        target's weight streaming is shared by them, 1.5x), linear in between and flat past."""
        return 0.3 + (min(batch_size, 8) - 1) * (0.6 - 0.3) / 7

    @torch.no_grad()
    def step(
        self,
        tokens: Tensor,  # [B] int64, row b's token at position cache.lengths[b] + offset
        cache: StaticKVCache,  # the target's; rows hold offset draft tokens past their lengths
        offset: int,  # draft tokens already written past each row's committed length
    ) -> Tensor:  # [B, V] fp32 next-token logits (the shortlist exact, the rest 4-bit)
        c = self.config
        batch = tokens.shape[0]
        positions = cache.lengths + offset  # [B]
        span = int(positions.max()) + 1  # keys any row reads
        if span > cache.max_len:
            raise ValueError(
                f"drafting at position {span - 1} needs a cache longer than {cache.max_len}; "
                "reserve room for the draft before drafting"
            )
        cos, sin = self.target._rope(tokens.device)
        # Each row sees its committed keys and its own draft tokens, not other rows' padding.
        visible = torch.arange(span, device=tokens.device) <= positions[:, None]  # [B, S]
        x = _scripted_layer_loop()(
            self.target.tok_embeddings.weight[tokens].float(),  # [B, dim]
            _rotation(cos[positions], sin[positions]),
            cache.k,
            cache.v,
            torch.arange(batch, device=tokens.device),
            positions,
            visible[:, None, None] if batch > 1 else None,
            span,
            self.weights,
            self.norms,
            [c.n_heads, c.n_kv_heads, c.head_dim, c.dim, c.hidden_dim],
            c.norm_eps,
        )
        x = F.rms_norm(x, (c.dim,), self.target.norm.weight, c.norm_eps)  # [B, dim]
        logits = self.head(x)  # [B, V]
        best = logits.topk(self.shortlist, dim=-1).indices  # [B, shortlist]
        exact = (self.head_rows[best].float() @ x[:, :, None]).squeeze(-1)  # [B, shortlist]
        return logits.scatter_(1, best, exact)
