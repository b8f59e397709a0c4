"""Text generation with decoder-only transformers (GPT-2, Llama, Mistral, Qwen2): loading, quantization, sampling, generation, evaluation."""
