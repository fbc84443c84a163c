"""The per-rank session: one attach (``session.RankSession``) and its role objects.

``leader.StageLeader``, ``masks.StageMasks``, ``reader.MaskReader``,
``followers.TpFollower`` and ``reader.FollowerRows``; ``roles`` says which
rank holds which. Nothing is imported here, so that a module that needs
only ``digest`` (the run's journal) does not pull in torch.
"""
