"""The decoding engine: draft-tree types, tree topology, acceptance rules, sampling, the decode
loop, the speculation controller and the target adapters."""
