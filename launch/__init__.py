"""Command line, cluster configs, workloads, launchers and the per-rank program.

Nothing is imported here: a process that only needs ``gramcoord.launch.procs``
(a spawned test child, a torchrun worker's trampoline) should not pay for
torch and xgrammar. Import the modules themselves, e.g.
``from gramcoord.launch.config import load_config``.
"""
