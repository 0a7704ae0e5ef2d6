"""The Llama model's config and its loading error: the part of ``llama`` that its loaders
(``llama_loading``) read too, kept apart so neither module imports the other's."""

from dataclasses import dataclass

from genrec_spec.errors import GenrecError


class LlamaError(GenrecError):
    """Bad input to the Llama model, the networks built on it (early exit, Medusa heads, EAGLE
    drafter) or its loaders."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int  # residual stream width (hidden_size)
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads; n_heads % n_kv_heads == 0 (grouped-query attention)
    hidden_dim: int  # feed-forward inner width (intermediate_size)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048  # longest sequence the RoPE tables (and any cache) may hold
    tie_embeddings: bool = False  # output projection reuses the token embedding matrix

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise LlamaError(
                f"dim {self.dim}, n_heads {self.n_heads}, n_kv_heads {self.n_kv_heads} do not fit",
                "dim must split into n_heads heads of even size and n_heads must be a multiple "
                "of n_kv_heads",
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
