"""Parts shared by language models: embeddings and the ``LanguageModule`` base class."""

__all__: list[str] = []
