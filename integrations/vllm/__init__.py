"""gramcoord as a vLLM 0.32 structured-output backend.

``gramcoord.integrations.vllm.plugin.register`` is the ``vllm.general_plugins``
entry point; ``backend`` holds the vLLM subclasses and ``agreement`` the
per-engine-step agreement. Importing this package imports no vLLM.
"""
