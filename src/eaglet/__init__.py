"""eaglet: train EAGLE-3 draft models for any Hugging Face causal LM and hand them to vLLM and SGLang."""

__version__ = "0.1.0"
