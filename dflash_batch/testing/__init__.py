"""What the tests and the benchmarks both build on, so neither imports the other: tiny random
checkpoints in the Hugging Face layout (checkpoints.py; a Kimi-K3 in kimi.py, with its DFlash2-MLA
drafter in kimi_pair.py and mla_drafter.py), tiny trained tokenizers in both layouts the product
reads (tokenizer.py), and /proc probes of processes (procs.py)."""
