"""Tree structure of a draft: who sees whom.

A tree of N nodes is given by ``parents`` ([B, N] int64): ``parents[b, i] < i`` (topological
order) and -1 marks a child of the root context. Node i sees itself and its ancestors, never its
siblings or other branches. Three views of that relation:

- ``ancestor_mask``: dense [B, N, N] bool (the reference and the CPU path use it),
- ``tree_depths``: [B, N] distance to the root context (position ids of the nodes),
- ``ancestor_bitmask``: the same mask packed 32 nodes per int32 word, the compact form the Triton
  kernel reads (N=512 costs 64 bytes per node instead of 512).
"""

import torch

from genrec_spec.errors import GenrecError

BITS_PER_WORD = 32


class TreeAttentionError(GenrecError):
    """Bad input to a tree-attention op."""


def check_parents(parents: torch.Tensor) -> None:  # parents: [B, N] integer
    """Raise ``TreeAttentionError`` unless ``-1 <= parents[b, i] < i`` everywhere.

    Reads the values, so on a GPU this is one host sync."""
    if parents.dim() != 2 or parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise TreeAttentionError(
            f"parents must be a [B, N] integer tensor, got shape {tuple(parents.shape)} "
            f"of {parents.dtype}",
            "pass parents[b, i] = index of node i's parent (-1 for the root context) as int64",
        )
    node = torch.arange(parents.shape[1], device=parents.device)
    bad = (parents < -1) | (parents >= node)
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise TreeAttentionError(
            f"parents[{b}, {i}] = {int(parents[b, i])}, but a node's parent must come before it "
            "(-1 <= parents[b, i] < i)",
            "order the tree's nodes topologically (parents first) and use -1 for children of "
            "the root context",
        )


def ancestor_mask(
    parents: torch.Tensor,  # [B, N] int64
    *,
    validate: bool = True,  # False: the caller already ran check_parents
) -> torch.Tensor:  # [B, N, N] bool
    """``mask[b, i, j]`` is True when node j is node i or one of its ancestors.

    Pointer doubling: ceil(log2 N) gathers instead of one step per tree level, with no host
    sync past the validation (a 512-node chain takes 9 steps, not 511)."""
    if validate:
        check_parents(parents)
    batch, n = parents.shape
    # Index n is a sentinel for the root context: its own "parent", so walking up past the top
    # of a branch stays there; its column is cut off at the end.
    top = parents.new_full((batch, 1), n)
    up = torch.cat([torch.where(parents < 0, n, parents), top], dim=1).long()  # [B, N+1]
    mask = torch.eye(n + 1, dtype=torch.bool, device=parents.device).repeat(batch, 1, 1)
    mask.scatter_(2, up.unsqueeze(2), True)  # [B, N+1, N+1]: distances 0 and 1
    reach = 1  # mask holds the ancestors at distances 0..reach; `up` the one at reach + 1
    up = up.gather(1, up)
    while reach < n - 1:
        mask |= mask.gather(1, up.unsqueeze(2).expand(-1, -1, n + 1))
        reach = 2 * reach + 1
        up = up.gather(1, up)
    return mask[:, :n, :n]


def tree_depths(parents: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, N] int64
    """Number of tree ancestors of each node (0 for children of the root context)."""
    return ancestor_mask(parents).sum(dim=-1) - 1


def ancestor_bitmask(parents: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, N, W] int32
    """``ancestor_mask`` packed little-endian into W = ceil(N / 32) int32 words per node: bit
    ``j % 32`` of word ``j // 32`` is set when node j is node i or one of its ancestors."""
    return pack_bits(ancestor_mask(parents))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:  # [B, M, N] bool -> [B, M, W] int32
    """Pack the last dim of a mask into int32 words, 32 columns per word (see
    ``ancestor_bitmask``)."""
    batch, m, n = mask.shape
    words = -(-n // BITS_PER_WORD)
    padded = torch.nn.functional.pad(mask, (0, words * BITS_PER_WORD - n))
    bits = padded.view(batch, m, words, BITS_PER_WORD).long()
    shifts = torch.arange(BITS_PER_WORD, device=mask.device)
    packed = (bits << shifts).sum(dim=-1)  # [B, M, W] in [0, 2^32)
    # Reinterpret as signed int32 (torch has no general uint32): bit 31 becomes the sign bit.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
