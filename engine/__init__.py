"""The per-rank engine: the step loop, its scheduler, logits sources, drafters and sampler."""
