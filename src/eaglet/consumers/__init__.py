"""The engines that load eaglet's exports (vLLM, SGLang, the speculators library), each read from its released
source, and `eaglet export --check`, which runs an export directory through them."""
