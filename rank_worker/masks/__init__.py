"""Masks of one rank: grammar state behind the gate, bitmask rows, jump-forward, apply."""
