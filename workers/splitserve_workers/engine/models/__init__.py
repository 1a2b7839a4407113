"""Model definitions (one file per family; Llama/Qwen2/Qwen3/Mistral share models/llama.py)."""
