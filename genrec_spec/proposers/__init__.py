"""Proposers: one drafter per module, each producing a DraftTree."""
