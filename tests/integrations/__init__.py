"""Tests of the host-library integrations (``gramcoord.integrations``: Hugging Face here, vLLM and SGLang in their folders)."""
