"""Runtime hooks inside DeepSpeed / GPT-NeoX training runs."""
