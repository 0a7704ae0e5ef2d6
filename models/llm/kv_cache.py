"""Static KV cache with pending tree entries: forward scores a tree, commit keeps one path.

A forward pass over a draft tree computes K/V for every tree node but cannot know yet which
branch will be accepted, so it stores them as *pending* entries past the committed ones.
``commit`` then appends, per row, the K/V of the accepted root-to-leaf path; everything else is
dropped. Rows may accept different numbers of tokens, so ``lengths`` is ragged: row b's committed
keys are ``k[:, b, :, :lengths[b]]``; positions past it hold stale values that nobody reads.

The pending entries of a pass over N nodes sit at positions ``[start, start + N)`` of every row,
with ``start`` at least the longest row's length: right after the committed keys, in the same
buffer, so attention can read [committed | tree] keys as one slice without copying the cache
(``tree_attention``'s dense CPU path does).

A pass may also *grow* the pending tree instead of replacing it (``begin_pass(n, grow=True)``):
its n entries go after the earlier passes' ones, and commit then picks its path among all of
them. Beam search grows one tree per row this way, its beams being the tree's branches.
"""

import torch

from genrec_spec.errors import GenrecError


class KVCacheError(GenrecError):
    """Bad use of a ``StaticKVCache``."""


class StaticKVCache:
    """Preallocated per-layer K/V for B rows of up to ``max_len`` tokens each.

    Index tensors passed to ``commit`` and ``reorder`` are checked for shape but not for values:
    reading values would cost a host sync on every decoding step.

    Every position past a row's length holds finite numbers (zeros, or K/V the model wrote and
    that were not kept), which is what lets attention read them under a -inf mask
    (``prepare_tree(..., finite_padding=True)``).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size < 1 or max_len < 1:
            raise KVCacheError(
                f"a cache needs batch_size >= 1 and max_len >= 1, got {batch_size} and {max_len}",
                "pass positive sizes",
            )
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [n_layers, B, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [n_layers, B, Hkv, S, D]
        self._lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [B]
        # Host-side upper bound on lengths.max(): lets begin_pass check room and place the
        # pending entries without a host sync (commit adds K, an upper bound of n); on CPU,
        # where reading lengths is free, begin_pass makes it exact.
        self._length_bound = 0
        # (start, N) of the pending entries (of the last pass, or of every pass since the last
        # commit when passes grow the tree); the last pass's own are the last ``new`` of them.
        self.pending: tuple[int, int] | None = None
        self.new = 0
        self.pending_parents: torch.Tensor | None = None  # [B, N] the pending tree's topology

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def lengths(self) -> torch.Tensor:  # [B] int64 committed tokens per row
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: torch.Tensor) -> None:  # [B] int64
        # Set directly (e.g. after copying K/V in from another cache): read them once (a host
        # sync) so the bound on the longest row, which places pending entries, stays true.
        self._lengths = lengths
        self._length_bound = int(lengths.max())
        self.pending = None

    def begin_pass(self, n: int, grow: bool = False) -> None:
        """Make room for a forward pass over n tree nodes per row: check every row can still
        commit n tokens, and place the pass's pending entries after the longest row, or, with
        ``grow`` and entries pending, after those (see the module docstring)."""
        if grow and self.pending is not None:
            start, kept = self.pending
            if start + kept + n > self.max_len:
                raise KVCacheError(
                    f"the pending tree holds {kept} nodes after {start} positions and this pass "
                    f"adds {n}, more than the cache's max_len {self.max_len}",
                    "reserve room first (cache.reserve) or grow the tree by fewer nodes",
                )
            self.pending, self.new = (start, kept + n), n
            return
        if self.k.device.type == "cpu" or self._length_bound + n > self.max_len:
            # Exact on CPU, where it costs nothing; on a GPU the one host sync, near capacity.
            self._length_bound = int(self._lengths.max())
            if self._length_bound + n > self.max_len:
                raise KVCacheError(
                    f"a row holds {self._length_bound} committed tokens and this pass adds {n}, "
                    f"more than the cache's max_len {self.max_len}",
                    "create the cache with a larger max_len (model.new_cache(batch_size, "
                    "max_len=...)) or shorten the prompt / max_new_tokens",
                )
        self.pending, self.new = (self._length_bound, n), n

    def set_pending(
        self,
        layer: int,
        k: torch.Tensor,  # [B, Hkv, N, D]
        v: torch.Tensor,  # [B, Hkv, N, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # pending k, v of this layer: [B, Hkv, N, D] each
        """Store one layer's K/V of the current pass (the last ``new`` pending entries); returns
        all pending entries of the layer (views of the cache at positions [start, start + N),
        see the module docstring)."""
        start, n = self.pending
        first = start + n - self.new
        self.k[layer, :, :, first : start + n].copy_(k)
        self.v[layer, :, :, first : start + n].copy_(v)
        return self.k[layer, :, :, start : start + n], self.v[layer, :, :, start : start + n]

    def commit(
        self,
        node_idx: torch.Tensor,  # [B, K] int64: per row, a root-to-leaf path of pending nodes
        n: torch.Tensor,  # [B] int64: how many of them to keep, 0 <= n[b] <= K
    ) -> None:
        """Append the pending K/V of nodes ``node_idx[b, :n[b]]`` at positions
        ``lengths[b] .. lengths[b] + n[b] - 1`` and advance ``lengths`` by n.

        Without a Python loop over rows: every row writes all K slots; slots past n[b] land
        beyond the new length, where nothing reads them. They stay inside the buffer because
        begin_pass checked lengths + N <= max_len and K <= N. The pending entries are gathered
        before any slot is written, so writes over them (a row shorter than the longest) are
        harmless."""
        if self.pending is None:
            raise KVCacheError(
                "commit called with no pending entries",
                "run the model's forward on this cache first (each forward's entries can be "
                "committed once)",
            )
        start, n_nodes = self.pending
        n_layers, batch, heads, _, head_dim = self.k.shape
        if node_idx.dim() != 2 or node_idx.shape[0] != batch or node_idx.shape[1] > n_nodes:
            raise KVCacheError(
                f"node_idx has shape {tuple(node_idx.shape)}, expected [B={batch}, K] with "
                f"K <= {n_nodes} (the nodes of the last forward)",
                "pass one path per row",
            )
        if tuple(n.shape) != (batch,):
            raise KVCacheError(
                f"n has shape {tuple(n.shape)}, expected [B={batch}]", "pass one count per row"
            )
        width = node_idx.shape[1]
        if width > 0:
            slots = torch.arange(width, device=node_idx.device)
            index_shape = (n_layers, batch, heads, width, head_dim)
            src = (start + node_idx.long()).view(1, batch, 1, width, 1).expand(index_shape)
            dst = (self._lengths[:, None] + slots).view(1, batch, 1, width, 1).expand(index_shape)
            self.k.scatter_(3, dst, self.k.gather(3, src))
            self.v.scatter_(3, dst, self.v.gather(3, src))
        self._lengths = self._lengths + n.long()
        self._length_bound += width
        self.pending = None

    def reorder(self, batch_idx: torch.Tensor) -> None:  # batch_idx: [B'] int64
        """Keep rows ``batch_idx`` (repeats allowed, e.g. beam search): new row i is old row
        batch_idx[i]. Pending entries follow (they live in the same buffers, at the same
        positions), so a commit after a reorder still works."""
        if batch_idx.dim() != 1 or batch_idx.numel() == 0:
            raise KVCacheError(
                f"batch_idx must be a non-empty 1-D index tensor, got shape "
                f"{tuple(batch_idx.shape)}",
                "pass the old row of each new row",
            )
        self.k = self.k.index_select(1, batch_idx)
        self.v = self.v.index_select(1, batch_idx)
        self._lengths = self._lengths.index_select(0, batch_idx)

    def reserve(self, needed: int, limit: int) -> None:
        """Make room for ``needed`` positions per row: when short, reallocate to twice the size
        (at least ``needed``, at most ``limit``: the model's), so a growing sequence copies its
        K/V a logarithmic number of times. Keeps the committed K/V, the lengths and the pending
        entries (positions do not move)."""
        if needed <= self.max_len:
            return
        extra = min(max(needed, 2 * self.max_len), limit) - self.max_len
        n_layers, batch, heads, _, head_dim = self.k.shape
        pad = self.k.new_zeros(n_layers, batch, heads, extra, head_dim)  # finite padding
        self.k, self.v = torch.cat([self.k, pad], dim=3), torch.cat([self.v, pad], dim=3)

    def truncate(self, lengths: torch.Tensor) -> None:  # lengths: [B] int64
        """Roll rows back to ``lengths`` committed tokens (never forward); drops pending
        entries, whose positions were relative to the old lengths."""
        lengths = lengths.to(device=self.lengths.device, dtype=torch.int64)
        if tuple(lengths.shape) != (self.batch_size,):
            raise KVCacheError(
                f"truncate lengths have shape {tuple(lengths.shape)}, expected "
                f"[B={self.batch_size}]",
                "pass one length per row",
            )
        if bool(((lengths < 0) | (lengths > self.lengths)).any()):
            raise KVCacheError(
                f"truncate to {lengths.tolist()} but rows hold {self.lengths.tolist()}",
                "truncate only rolls back: pass 0 <= lengths <= cache.lengths",
            )
        self._lengths = lengths
        self.pending = None
