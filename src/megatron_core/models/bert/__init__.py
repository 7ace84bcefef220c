"""The BERT model, its heads and layer specs (``megatron.core.models.bert``)."""
