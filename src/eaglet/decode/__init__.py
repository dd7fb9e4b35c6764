"""Speculative decoding with an EAGLE-3 draft: the engine and `eaglet eval`."""
