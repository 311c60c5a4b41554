"""regen.integrations: regen inside the training frameworks users run (hf.py: the Hugging Face Trainer).

Each module imports its framework only when used, so regen imports without it."""
