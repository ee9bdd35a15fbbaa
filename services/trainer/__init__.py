"""The trainer: owns training runs (a LoRA adapter and an optimizer each, over a shared frozen
base model) and executes their requests in seq_id order."""
