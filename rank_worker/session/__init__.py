"""The per-rank session: submit, step, bitmask, apply, advance, and the TP-side reader."""
