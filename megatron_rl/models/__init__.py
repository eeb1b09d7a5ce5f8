"""Model families (HF config -> Megatron ModelConfig + weight table) and the GPT builders."""
