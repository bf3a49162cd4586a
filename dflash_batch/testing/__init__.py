"""What the tests and the benchmarks both build on, so neither imports the other: tiny random
checkpoints in the Hugging Face layout (checkpoints.py), tiny trained tokenizers in both layouts
the product reads (tokenizer.py), and /proc probes of child processes (procs.py)."""
