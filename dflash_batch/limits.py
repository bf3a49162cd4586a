"""Limits the job file checks and the engine sizes its tensors by (a leaf: both import it)."""

MAX_LOGIT_BIAS = 300  # token ids with a bias, per request (OpenAI's limit)
