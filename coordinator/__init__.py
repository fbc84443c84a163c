"""Cross-rank agreement on grammar readiness, failures and poison.

The coordinator sees only sequence numbers, states, integer reason codes and
16-byte keys; ``rank_worker`` owns what they mean. A stage leader drives it
through ``coordinator.Coordinator`` and the ``Member`` protocol; the rank
grid is ``layout.ParallelLayout``; the control groups are ``runtime.Runtime``.

Nothing is imported here, so ``coordinator.config`` imports without torch.
"""
