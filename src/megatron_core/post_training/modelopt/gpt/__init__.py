"""Model Optimizer's GPT layer spec and checkpoint key hooks (Megatron-Core's ``post_training.modelopt.gpt``)."""
