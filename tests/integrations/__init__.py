"""Tests of the host-library integrations (``gramcoord.rank_worker.integrations``)."""
