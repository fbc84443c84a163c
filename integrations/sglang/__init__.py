"""gramcoord as a registered SGLang 0.5.23 grammar backend.

``gramcoord.integrations.sglang.plugin.register`` adds the ``gramcoord``
name to SGLang's grammar-backend registry and CLI choices; ``backend`` holds
the SGLang subclasses and ``agreement`` the cross-rank decision made where
SGLang's ``GrammarManager`` takes a grammar out of its ``Future``. Importing
this package imports no SGLang.
"""

__all__ = ["agreement", "backend", "plugin"]
