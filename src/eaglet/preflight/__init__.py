"""Preflight: everything that can fail after the model load, checked before it, in seconds."""
