"""MIMO modality submodules: the abstract base and the vision and audio modalities."""
