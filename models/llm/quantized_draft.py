"""The target at 4 bits as its own draft (quantised self-speculation), on the target's KV cache.

SmolLM2's shipped GGUF stores every layer matrix as Q4_1 codes; the fp32 target is those codes
dequantised. Run through our 4-bit CPU ops (``kernels.q4``), the same model drafts a token in a
fraction of a target step, and agrees with the target's greedy token nearly always: only the
rounding of the matmuls' inputs differs (to bfloat16, or int8 on AVX2 CPUs; scales, sums and
everything else are fp32).
No training, no second model.

Why it is cheap: at batch 1 a target step is mostly streaming its fp32 weights, while the draft
streams 4-bit codes with fp16 scales (about a sixth of the bytes); the whole layer stack for
one token per row is one C++ op (``q4_decode_layers``: matmuls with fused RMS norms and q/k/v and
gate/up fused, RoPE, cache writes, attention, SiLU), so no time goes to dispatching small ops.

The LM head (SmolLM2's is its Q8_0 embedding table, 28M weights) at 4 bits is cheap but alone
would cut agreement (its top two tokens are often close); so the head's top ``shortlist``
tokens are rescored exactly with the target's own fp32 rows,
which restores the target's ranking whenever its best token is among them.

The cache: the target's committed K/V are what the draft would have computed, up to rounding,
so the draft reads them and writes its own K/V for the drafted tokens just past each row's
committed length, where nothing reads them once the draft is done: the target's next pass
writes its pending entries over them (``StaticKVCache``: positions past a row's length are
stale). The draft owns no cache and commits nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from genrec_spec.cache import cache_dir
from genrec_spec.data_pipelines.atomic import json_made_once
from genrec_spec.kernels.q4 import load as load_q4
from genrec_spec.kernels.q4 import path as q4_path
from genrec_spec.machine import describe, machine_key, time_in_turns
from genrec_spec.models.llm.kv_cache import StaticKVCache
from genrec_spec.models.llm.llama import Llama
from genrec_spec.models.llm.q4 import Q4Codes, Q4Error, Q4Weight, cat_codes, quantize_q4

# Token candidates of the 4-bit LM head rescored with the target's fp32 head rows.
SHORTLIST = 8
# Part of relative_cost's key: bump it when the draft's or the target's code changes what a step
# costs.
COST_VERSION = 1


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
                raise Q4Error(
                    f"4-bit codes of shape {tuple(c.codes.shape)} for {name}, whose weight is "
                    f"{tuple(target.get_parameter(name).shape)}: the codes are of another model",
                    "pass the codes of the target's own checkpoint, or none to quantise it",
                )
        self.target = target
        self.config = target.config
        self.shortlist = shortlist
        self._costs: dict[str, float] = {}  # relative_cost's, by key

        def q4(*names: str) -> Q4Weight:
            return cat_codes(
                [codes.get(n) or quantize_q4(target.get_parameter(n)) for n in names]
            ).pack()

        if target.tok_embeddings.weight.dtype != torch.float32:
            raise Q4Error(
                f"the 4-bit draft runs on an fp32 target's KV cache; this target is "
                f"{target.tok_embeddings.weight.dtype}",
                "load it in fp32 to draft with quant",
            )
        load_q4()
        self.weights, self.norms = [], []  # q4_decode_layers' lists
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
        from genrec_spec.models.llm.llama_loading import read_gguf_config, read_gguf_q4

        if read_gguf_config(path) != target.config:
            raise Q4Error(
                f"{path} holds another model than this target ({target.config})",
                "build the draft from the target's own GGUF file, or QuantizedDraft(target) to "
                "quantise it",
            )
        return cls(target, read_gguf_q4(path), shortlist)

    def relative_cost(self, batch_size: int = 1) -> float:
        """A draft step's time relative to a target step at this batch size on this machine, by
        which the controller weighs drafting: timed on first use (``time_relative_cost``, well
        under a second for SmolLM2) and kept per machine, thread count, model shape, 4-bit loop
        and batch size under ``$GENREC_SPEC_CACHE/draft_cost``. It differs between CPUs (the
        4-bit loop, memory bandwidth) and grows with the batch, as the 4-bit products' cost
        grows with rows where the fp32 target's weight streaming is shared by them."""
        shapes = [tuple(w.shape) for w in self.weights] + [tuple(self.head.codes.shape)]
        threads = torch.get_num_threads()
        key = machine_key("draft_cost", threads, q4_path(), shapes, batch_size, COST_VERSION)
        if key not in self._costs:
            record = json_made_once(
                cache_dir() / "draft_cost" / f"{key}.json",
                lambda: {
                    "relative_cost": self.time_relative_cost(batch_size),
                    "machine": describe(),
                },
                valid=lambda record: float(record["relative_cost"]) > 0,
            )
            self._costs[key] = float(record["relative_cost"])
        return self._costs[key]

    @torch.no_grad()
    def time_relative_cost(self, batch_size: int, context: int = 64, repeats: int = 5) -> float:
        """Median draft step over median target step (one token per row after a
        ``context``-token prompt, the LM head included in both), taking turns ``repeats``
        times after a round of warm-up."""
        context = min(context, self.config.max_seq_len - 2)  # a short model keeps a shorter one
        cache = self.target.new_cache(batch_size, context + 2)
        self.target.encode(torch.ones(batch_size, context, dtype=torch.long), cache)
        cache.commit(
            torch.arange(context).expand(batch_size, context), torch.full((batch_size,), context)
        )
        token = torch.ones(batch_size, 1, dtype=torch.long)  # the content does not change times
        seconds = time_in_turns(
            {
                "draft": lambda: self.step(token[:, 0], cache, 0),
                "target": lambda: self.target(token, cache),
            },
            repeats,
        )
        return seconds["draft"] / seconds["target"]

    @torch.no_grad()
    def step(
        self,
        tokens: Tensor,  # [B] int64, row b's token at position cache.lengths[b] + offset
        cache: StaticKVCache,  # the target's; rows hold offset draft tokens past their lengths
        offset: int,  # draft tokens already written past each row's committed length
    ) -> Tensor:  # [B, V] fp32 next-token logits (the shortlist exact, the rest 4-bit)
        c = self.config
        positions = cache.lengths + offset  # [B]
        span = int(positions.max()) + 1  # keys any row reads
        if span > cache.max_len:
            raise Q4Error(
                f"drafting at position {span - 1} needs a cache longer than {cache.max_len}",
                "reserve room for the draft before drafting",
            )
        cos, sin = self.target._rope(tokens.device)  # [max_len, D]
        x = torch.ops.genrec_spec.q4_decode_layers(
            self.target.tok_embeddings.weight[tokens],  # [B, dim]
            cos[positions],  # [B, D]
            sin[positions],
            cache.k,
            cache.v,
            positions,
            self.weights,
            self.norms,
            c.n_heads,
            c.n_kv_heads,
            c.norm_eps,
        )  # [B, dim]
        x = F.rms_norm(x, (c.dim,), self.target.norm.weight, c.norm_eps)  # [B, dim]
        logits = self.head(x)  # [B, V]
        best = logits.topk(self.shortlist, dim=-1).indices  # [B, shortlist]
        exact = (self.head_rows[best].float() @ x[:, :, None]).squeeze(-1)  # [B, shortlist]
        return logits.scatter_(1, best, exact)
