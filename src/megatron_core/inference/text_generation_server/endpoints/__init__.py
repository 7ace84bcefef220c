"""Endpoints of the legacy text-generation server (Megatron-Core's ``text_generation_server.endpoints``)."""
