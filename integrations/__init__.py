"""Host-engine integrations of gramcoord, installed as ``gramcoord.integrations``."""
