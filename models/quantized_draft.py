"""The target at 4 bits as its own draft (quantised self-speculation), on the target's KV cache.

SmolLM2's shipped GGUF stores every layer matrix as Q4_1 codes; the fp32 target is those codes
dequantised. Run through ATen's bfloat16 int4 kernel (``models.q4``), the same model drafts a
token in about a third of a target step at one thread, and agrees with the target's greedy
token ~99% of the time (SmolLM2 on HumanEval prompts: 1,270 of 1,280 positions): only the
bfloat16 rounding of activations and scales differs. No training, no second model.

Why it is cheap: at batch 1 a CPU step is mostly reading weights (fp32: ~540 MB; 4-bit codes:
~70 MB), and everything else is kept lean: one fused kernel call for q/k/v and one for
gate/up per layer, one token per call, the residual stream in fp32, matmul inputs in bf16.

The LM head (SmolLM2's is its Q8_0 embedding table, 28M weights) at 4 bits costs ~1.6 ms but
alone would lose ~7% agreement (its top two tokens are often close); so the head's top
``shortlist`` tokens are rescored exactly with the target's own fp32 rows, which restores the
target's ranking whenever its best token is among them (top 8: every position measured).

The cache: the target's committed K/V are what the draft would have computed, up to rounding,
so the draft reads them and writes its own K/V for the drafted tokens just past each row's
committed length, where nothing reads them once the draft is done: the target's next pass
writes its pending entries over them (``StaticKVCache``: positions past a row's length are
stale). The draft owns no cache and commits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from genrec_spec.models.kv_cache import StaticKVCache
from genrec_spec.models.llama import Llama, apply_rope
from genrec_spec.models.q4 import Q4Codes, Q4Weight, cat_codes, quantize_q4

# Token candidates of the 4-bit LM head rescored with the target's fp32 head rows.
SHORTLIST = 8


@dataclass(frozen=True)
class _Layer:
    qkv: Q4Weight  # [Hq*D + 2*Hkv*D, dim]
    wo: Q4Weight  # [dim, Hq*D]
    gate_up: Q4Weight  # [2*hidden, dim]
    down: Q4Weight  # [dim, hidden]
    attention_norm: Tensor  # [dim] the target's
    ffn_norm: Tensor  # [dim] the target's


class QuantizedDraft:
    """A 4-bit copy of a native ``Llama``'s layers and LM head that scores one token per row
    per call on the target's own cache (``step``)."""

    def __init__(
        self, target: Llama, codes: dict[str, Q4Codes] | None = None, shortlist: int = SHORTLIST
    ) -> None:
        """codes: 4-bit codes per parameter name of ``target`` (``read_gguf_q4``: exactly the
        weights a GGUF target was dequantised from); any matrix not given is rounded from the
        target's own weights (``quantize_q4``), so ``codes=None`` quantises a target loaded from
        any checkpoint. Needs dimensions the int4 kernel takes (multiples of 32 and 16)."""
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

        self.layers = []
        for i, block in enumerate(target.layers):
            p = f"layers.{i}."
            self.layers.append(
                _Layer(
                    qkv=q4(*(f"{p}attention.{w}.weight" for w in ("wq", "wk", "wv"))),
                    wo=q4(f"{p}attention.wo.weight"),
                    gate_up=q4(f"{p}feed_forward.w1.weight", f"{p}feed_forward.w3.weight"),
                    down=q4(f"{p}feed_forward.w2.weight"),
                    attention_norm=block.attention_norm.weight.detach(),
                    ffn_norm=block.ffn_norm.weight.detach(),
                )
            )
        head = "tok_embeddings.weight" if target.output is None else "output.weight"
        self.head = q4(head)
        self.head_rows = target.get_parameter(head).detach()  # [V, dim] exact, for the shortlist

    @classmethod
    def from_gguf(cls, target: Llama, path: str | Path, shortlist: int = SHORTLIST):
        """The draft of a target loaded from the GGUF file ``path`` (``Llama.from_gguf``): its
        Q4_1 matrices as stored; the rest (a Q8_0 LM head) rounded to 4 bits."""
        from genrec_spec.models.llama_loading import read_gguf_config, read_gguf_q4

        if read_gguf_config(path) != target.config:
            raise ValueError(
                f"{path} holds another model than this target ({target.config}); build the "
                "draft from the target's own GGUF file, or QuantizedDraft(target) to quantise it"
            )
        return cls(target, read_gguf_q4(path), shortlist)

    def relative_cost(self) -> float:
        """A draft step's time relative to a target step, batch 1, one thread: SmolLM2 on this
        project's 2-core CPU, measured (``bench llm`` prints the draft's share)."""
        return 0.3

    @torch.no_grad()
    def step(
        self,
        tokens: Tensor,  # [B] int64, row b's token at position cache.lengths[b] + offset
        cache: StaticKVCache,  # the target's; rows hold offset draft tokens past their lengths
        offset: int,  # draft tokens already written past each row's committed length
    ) -> Tensor:  # [B, V] fp32 next-token logits (the shortlist exact, the rest 4-bit)
        c = self.config
        batch, hq, hkv, hd = tokens.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
        positions = cache.lengths + offset  # [B]
        span = int(positions.max()) + 1  # keys any row reads
        if span > cache.max_len:
            raise ValueError(
                f"drafting at position {span - 1} needs a cache longer than {cache.max_len}; "
                "reserve room for the draft before drafting"
            )
        cos, sin = (t[positions][:, None, None] for t in self.target._rope(tokens.device))
        rows = torch.arange(batch, device=tokens.device)
        # Each row sees its committed keys and its own draft tokens, not other rows' padding.
        visible = torch.arange(span, device=tokens.device) <= positions[:, None]  # [B, S]
        visible = visible[:, None, None] if batch > 1 else None
        bf16, dtype = torch.bfloat16, cache.dtype
        x = self.target.tok_embeddings.weight[tokens].float()  # [B, dim]
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (c.dim,), layer.attention_norm, c.norm_eps).to(bf16)
            qkv = layer.qkv(h).float().view(batch, 1, hq + 2 * hkv, hd)
            qk = apply_rope(qkv[:, :, : hq + hkv], cos, sin)[:, 0]  # [B, Hq + Hkv, D]
            cache.k[i][rows, :, positions] = qk[:, hq:].to(dtype)
            cache.v[i][rows, :, positions] = qkv[:, 0, hq + hkv :].to(dtype)
            out = F.scaled_dot_product_attention(
                qk[:, :hq, None].to(dtype),  # [B, Hq, 1, D]
                cache.k[i][:, :, :span],
                cache.v[i][:, :, :span],
                attn_mask=visible,
                enable_gqa=True,
            )  # [B, Hq, 1, D]
            x = x + layer.wo(out.reshape(batch, hq * hd).to(bf16)).float()
            h = F.rms_norm(x, (c.dim,), layer.ffn_norm, c.norm_eps).to(bf16)
            gate, up = layer.gate_up(h).split(c.hidden_dim, dim=-1)
            x = x + layer.down(F.silu(gate) * up).float()
        x = F.rms_norm(x, (c.dim,), self.target.norm.weight, c.norm_eps)  # [B, dim]
        logits = self.head(x.to(bf16)).float()  # [B, V]
        best = logits.topk(self.shortlist, dim=-1).indices  # [B, shortlist]
        exact = (self.head_rows[best].float() @ x[:, :, None]).squeeze(-1)  # [B, shortlist]
        return logits.scatter_(1, best, exact)
