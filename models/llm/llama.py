"""A Llama-family decoder (SmolLM2, Llama 2/3 without rope scaling) that scores draft trees.

One forward pass takes the tokens of a tree per row, attends to the row's committed KV cache
plus each node's own ancestors (``genrec_spec.kernels.tree_attention``), and leaves the tree's
K/V pending in the cache; the caller commits the accepted path (``StaticKVCache.commit``). A
chain (ordinary prefill or one decode step) is the tree whose parents are ``i - 1``.

Weights use the Hugging Face layout (q/k rows in rotate-half order), so ``from_hf`` loads
transformers checkpoints as they are and ``from_gguf`` undoes llama.cpp's q/k permutation.
"""

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from genrec_spec.kernels import TreePlan, prepare_tree, tree_attention
from genrec_spec.models.llm.cpu_linear import linear
from genrec_spec.models.llm.kv_cache import StaticKVCache
from genrec_spec.models.llm.llama_config import LlamaConfig, LlamaError
from genrec_spec.models.llm.llama_loading import read_gguf, read_hf


def rope_tables(
    config: LlamaConfig, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin: [max_seq_len, D] fp32
    """cos/sin of position * inv_freq, computed as transformers does (fp32 outer product), laid
    out for ``apply_rope``: cos as [cos, cos] and sin as [-sin, sin] over the two halves."""
    half = config.head_dim // 2
    exponents = torch.arange(half, dtype=torch.int64, device=device).float() / half
    inv_freq = 1.0 / (config.rope_theta**exponents)  # [D/2]
    angles = torch.outer(torch.arange(config.max_seq_len, device=device).float(), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(
    x: torch.Tensor,  # [B, N, H, D]
    cos: torch.Tensor,  # [B, N, 1, D] fp32 from rope_tables, at each node's position
    sin: torch.Tensor,  # [B, N, 1, D] fp32
) -> torch.Tensor:  # [B, N, H, D], x's dtype
    """Rotate-half RoPE (the Hugging Face layout), in fp32 whatever x's dtype: with x = [x1, x2]
    it gives [x1 cos - x2 sin, x2 cos + x1 sin], here as x * cos + [x2, x1] * sin with the
    tables' signs (3 ops instead of split, 4 products, 2 sums and a concatenation)."""
    x32 = x.float()
    return (x32 * cos + x32.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def begin_tree_pass(
    cache: StaticKVCache,
    n: int,  # N tree nodes per row
    parents: torch.Tensor | None,  # [B, N] int64, -1 = child of the committed root; None: a chain
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [max_seq_len, D] fp32 from rope_tables
    grow: bool = False,
) -> tuple[TreePlan, torch.Tensor, torch.Tensor]:  # plan; cos, sin [B, N, 1, D] fp32
    """What every layer of one forward pass shares: the tree's bookkeeping (validation, masks,
    depths), room for the pass's pending K/V in the cache, and the RoPE rows at each node's
    position ``cache.lengths[b] + depth(i)``. The cache's padding is finite (see StaticKVCache),
    so attention may read it under its mask.

    With ``grow`` the N nodes extend the cache's pending tree: their parents index its nodes
    (earlier passes' first, then these), and attention queries the new nodes alone."""
    if parents is None:
        batch = cache.batch_size
        parents = torch.arange(-1, n - 1, device=cache.lengths.device).expand(batch, n)
    grow = grow and cache.pending is not None
    if grow:
        parents = torch.cat([cache.pending_parents, parents], dim=1)
    plan = prepare_tree(
        parents, cache.lengths, cache.max_len, dtype=cache.dtype, finite_padding=True, queries=n
    )
    cache.begin_pass(n, grow)  # raises before any layer runs if a row has no room for n tokens
    cache.pending_parents = parents
    # [B, N] < max_seq_len: the cache's slots bound a one-pass tree's positions (it holds at
    # most max_seq_len), beam search a grown tree's (its slots may hold more)
    positions = cache.lengths[:, None] + plan.depths
    cos, sin = rope
    return plan, cos[positions][:, :, None], sin[positions][:, :, None]


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) through ``cpu_linear.linear``, the
    product by this CPU's fastest path; bias-free."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, dim] -> [B, N, dim]
        # Normalise in fp32 and scale in x's dtype, as transformers' LlamaRMSNorm does; one
        # fused op gives its values bit for bit, without seven ops' dispatch per call.
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # which slot of the KV cache this layer owns
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.wq = Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def qkv(
        self,
        x: torch.Tensor,  # [B, N, dim]
        cos: torch.Tensor,  # [B, N, 1, D] fp32, at each node's position (see apply_rope)
        sin: torch.Tensor,  # [B, N, 1, D] fp32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [B, N, Hq, D]; k, v [B, N, Hkv, D]
        """The projections, RoPE applied to q and k (what any attention pattern starts from)."""
        batch, n, _ = x.shape
        q = self.wq(x).view(batch, n, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, n, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, n, self.n_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [B, N, dim]
        cos: torch.Tensor,  # [B, N, 1, D] fp32, at each node's position (see apply_rope)
        sin: torch.Tensor,  # [B, N, 1, D] fp32
        cache: StaticKVCache,
        plan: TreePlan,  # the pass's tree over the committed cache, shared by all layers
    ) -> torch.Tensor:  # [B, N, dim]
        batch, n, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        dtype = cache.dtype
        # The pending entries land in the cache right after the longest row, so the attention
        # below reads [committed | tree] keys in place.
        k_tree, v_tree = cache.set_pending(self.layer, k.transpose(1, 2), v.transpose(1, 2))
        out = tree_attention(
            q.transpose(1, 2).to(dtype),
            cache.k[self.layer],
            cache.v[self.layer],
            plan.root_lens,
            k_tree,
            v_tree,
            plan.parents,
            plan=plan,
        )  # [B, Hq, N, D]
        return self.wo(out.transpose(1, 2).reshape(batch, n, -1).to(x.dtype))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = Linear(config.dim, config.hidden_dim, bias=False)  # gate
        self.w3 = Linear(config.dim, config.hidden_dim, bias=False)  # up
        self.w2 = Linear(config.hidden_dim, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, dim] -> [B, N, dim]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x, cos, sin, cache, plan):  # x: [B, N, dim] -> [B, N, dim]
        return self.around(x, lambda h: self.attention(h, cos, sin, cache, plan))

    def around(
        self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:  # x: [B, N, dim] -> [B, N, dim]
        """The block with ``attend`` (normed x -> the attention's output) as its attention: the
        cached tree attention of ``forward``, or a pattern of a training loop's own."""
        x = x + attend(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        # With tied embeddings the output projection is tok_embeddings.weight itself.
        self.output = (
            None if config.tie_embeddings else Linear(config.dim, config.vocab_size, bias=False)
        )
        # RoPE tables are plain attributes, not buffers, so model.to(torch.bfloat16) cannot
        # round them: they stay fp32 and follow the model's device on first use (_rope).
        self._rope_cos, self._rope_sin = rope_tables(config, "cpu")

    # --- loading -----------------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls, config: LlamaConfig, state_dict: dict[str, torch.Tensor], dtype=torch.float32
    ) -> "Llama":
        """Build a model around ``state_dict`` (this module's parameter names) without first
        initialising random weights."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, assign=True)
        return model.eval()

    @classmethod
    def from_gguf(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "Llama":
        """Load a llama.cpp GGUF file, dequantising every tensor (see ``llama_loading``)."""
        return cls.from_state_dict(*read_gguf(path), dtype=dtype)

    @classmethod
    def from_hf(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "Llama":
        """Load a Hugging Face folder (config.json + *.safetensors) of a Llama model."""
        return cls.from_state_dict(*read_hf(folder), dtype=dtype)

    # --- decoding ----------------------------------------------------------------------------

    def linear_shapes(self) -> list[tuple[int, int]]:
        """The weight shapes (out, in) of its products, each once: what `cpu_linear` chooses a
        path for (benchmarks measure them all before timing, `cpu_linear.measure_shapes`)."""
        head = self.tok_embeddings.weight if self.output is None else self.output.weight
        weights = [m.weight for m in self.modules() if isinstance(m, Linear)] + [head]
        return list(dict.fromkeys(tuple(w.shape) for w in weights))

    def new_cache(
        self, batch_size: int, max_len: int, dtype: torch.dtype | None = None
    ) -> StaticKVCache:
        """An empty cache on the model's device, in the model's dtype unless told otherwise."""
        if max_len > self.config.max_seq_len:
            raise LlamaError(
                f"max_len {max_len} exceeds the model's max_seq_len {self.config.max_seq_len}",
                "ask for a shorter cache (the model has no positions past max_seq_len)",
            )
        weight = self.tok_embeddings.weight
        return StaticKVCache(
            self.config.n_layers,
            batch_size,
            self.config.n_kv_heads,
            max_len,
            self.config.head_dim,
            dtype=dtype or weight.dtype,
            device=weight.device,
        )

    def _rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cos.device != device:
            self._rope_cos, self._rope_sin = rope_tables(self.config, device)
        return self._rope_cos, self._rope_sin

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, N] int64
        cache: StaticKVCache,
        parents: torch.Tensor | None = None,  # [B, N] int64, -1 = child of the committed root
        *,
        hidden_layers: tuple[int, ...] = (),
        grow: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:  # logits [B, N, V] fp32
        """Score a tree of N tokens per row against the committed cache.

        Node i sits at position ``cache.lengths[b] + depth(i)`` and sees the committed cache and
        its own tree ancestors. ``parents=None`` means a chain (prefill or decode step). The
        pass's K/V become the cache's pending entries; ``cache.lengths`` does not move.
        ``grow=True`` adds the nodes to the pending tree of earlier passes instead, parents
        indexing its nodes (see ``StaticKVCache``): only the new nodes are computed.

        ``hidden_layers`` follows transformers' ``output_hidden_states`` indexing: 0 is the
        embedding output, l the output of layer l, ``n_layers`` the final-normed state. With it,
        returns ``(logits, {l: hidden [B, N, dim]})``.

        Inference only (no_grad): the target is frozen in every method here, and a graph kept
        alive through the cache would grow with every step. Hidden states come out detached,
        ready as training inputs for draft heads.
        """
        self._check_forward(tokens, cache, parents, hidden_layers)
        x, hidden = self._trunk(tokens, cache, parents, hidden_layers, grow)
        logits = self._head(x)
        return (logits, hidden) if hidden_layers else logits

    def _head(self, x: torch.Tensor) -> torch.Tensor:  # normed [B, N, dim] -> logits [B, N, V] fp32
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return linear(x, weight).float()

    @torch.no_grad()
    def encode(
        self,
        tokens: torch.Tensor,  # [B, N] int64, a chain (a prompt)
        cache: StaticKVCache,
        *,
        hidden_layers: tuple[int, ...] = (),
    ) -> dict[int, torch.Tensor]:  # {l: [B, N, dim]}, as forward's hidden layers
        """``forward`` without the LM head: every layer's K/V become pending in ``cache``. A
        prompt's prefill reads no logits, and the head is the largest product of a long prompt
        (SmolLM2: 49,152 x 576 per token)."""
        self._check_forward(tokens, cache, None, hidden_layers)
        return self._trunk(tokens, cache, None, hidden_layers)[1]

    @torch.no_grad()
    def encode_last(
        self,
        tokens: torch.Tensor,  # [B, N] int64, right-padded prompts
        cache: StaticKVCache,
        lengths: torch.Tensor,  # [B] real tokens per row
    ) -> torch.Tensor:  # logits [B, 1, V] fp32 of each row's token lengths - 1
        """``encode``, then the LM head on each row's last real token alone: the scores of the
        first generated token come out of the prompt's own pass, as in transformers' prefill,
        instead of costing a pass of their own."""
        self._check_forward(tokens, cache, None, ())
        x = self._trunk(tokens, cache, None, ())[0]
        last = (lengths - 1).view(-1, 1, 1).expand(-1, 1, x.shape[2])
        return self._head(x.gather(1, last))

    def _trunk(
        self, tokens, cache, parents, hidden_layers: tuple[int, ...], grow: bool = False
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # normed [B, N, dim], {l: [B, N, dim]}
        """Every layer and the final norm: ``forward`` up to its LM head."""
        x, hidden = self._layers(tokens, cache, parents, self.config.n_layers, hidden_layers, grow)
        x = self.norm(x)
        if self.config.n_layers in hidden_layers:
            hidden[self.config.n_layers] = x
        return x, hidden

    @torch.no_grad()
    def forward_layers(
        self,
        tokens: torch.Tensor,  # [B, N] int64
        cache: StaticKVCache,
        parents: torch.Tensor | None = None,  # [B, N] int64, -1 = child of the committed root
        *,
        n_layers: int,
    ) -> torch.Tensor:  # [B, N, dim] hidden layer n_layers (not normed)
        """The first ``n_layers`` layers of ``forward`` alone (early exit): only their K/V become
        pending in ``cache``, the other layers' slots are left as they are. So a pass may run on
        the target's own cache, whose committed K/V of those layers are exactly what the
        truncated model would have computed (self-speculative drafting,
        ``models.llm.exit_head``)."""
        self._check_forward(tokens, cache, parents, (n_layers,))
        return self._layers(tokens, cache, parents, n_layers, ())[0]

    @torch.no_grad()
    def hidden_states(
        self,
        tokens: torch.Tensor,  # [B, N] int64
        cache: StaticKVCache,
        layers: tuple[int, ...],  # as forward's hidden_layers
    ) -> dict[int, torch.Tensor]:  # {l: [B, N, dim]}
        """``forward``'s hidden layers alone: the layers past the deepest one asked for and the
        LM head do not run (SmolLM2: EAGLE-3's layers 2 / 15 / 28 skip 2 of 30 layers and the
        head, ~25% of a forward's multiply-adds)."""
        if not layers:
            raise LlamaError("hidden_states needs layers", "name at least one (0 .. n_layers)")
        self._check_forward(tokens, cache, None, layers)
        deepest = max(layers)
        x, hidden = self._layers(tokens, cache, None, deepest, layers)
        if deepest == self.config.n_layers:
            hidden[deepest] = self.norm(x)
        return hidden

    def _layers(
        self, tokens, cache, parents, n_layers: int, hidden_layers: tuple[int, ...], grow=False
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # [B, N, dim], {l: [B, N, dim]}
        """Embed and run the first n_layers layers over one tree pass; collects hidden_layers."""
        rope = self._rope(tokens.device)
        plan, cos, sin = begin_tree_pass(cache, tokens.shape[1], parents, rope, grow)
        x = self.tok_embeddings(tokens)
        hidden = {0: x} if 0 in hidden_layers else {}
        for i, layer in enumerate(self.layers[:n_layers], start=1):
            x = layer(x, cos, sin, cache, plan)
            if i in hidden_layers:
                hidden[i] = x
        return x, hidden

    def _check_forward(self, tokens, cache, parents, hidden_layers) -> None:
        """Shapes and options only: reading tensor values would cost a host sync per step."""
        if tokens.dim() != 2 or tokens.shape[1] == 0 or tokens.dtype != torch.int64:
            raise LlamaError(
                f"tokens must be a non-empty [B, N] int64 tensor, got shape "
                f"{tuple(tokens.shape)} of {tokens.dtype}",
                "pass token ids as a [B, N] tensor of dtype torch.long",
            )
        if tokens.shape[0] != cache.batch_size:
            raise LlamaError(
                f"tokens have {tokens.shape[0]} rows but the cache has {cache.batch_size}",
                "create the cache with model.new_cache(batch_size=tokens.shape[0], ...)",
            )
        if parents is not None and parents.shape != tokens.shape:
            raise LlamaError(
                f"parents has shape {tuple(parents.shape)}, expected tokens' shape "
                f"{tuple(tokens.shape)}",
                "pass one parent index per tree node",
            )
        bad = [i for i in hidden_layers if not 0 <= i <= self.config.n_layers]
        if bad:
            raise LlamaError(
                f"hidden_layers {bad} out of range",
                f"use 0 (embeddings) .. {self.config.n_layers} (final-normed state)",
            )
