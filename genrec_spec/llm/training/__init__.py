"""Trained drafters for the LLM target: self-distillation data from the target's own
continuations, training, and checkpoints bound to the target (one module per concept)."""
