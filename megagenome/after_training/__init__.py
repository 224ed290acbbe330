"""The model's life after training (layer L4): a trained model loaded for inference, evaluation, variant scoring,
export (safetensors, Hugging Face) and INT8."""
