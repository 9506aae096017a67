"""Tessel model families (GPT-2, Llama, Qwen2/3, Mistral), built from parallel layers."""
