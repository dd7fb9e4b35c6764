"""Data: conversation readers, chat rendering with loss masks, draft vocabulary, regeneration."""
