"""Post-training: SFT, LoRA, DPO and GRPO losses, rewards, data and generation."""
