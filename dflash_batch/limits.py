"""Limits the job file checks and the engine sizes its tensors by (a leaf: both import it)."""

MAX_LOGIT_BIAS = 300  # token ids with a bias, per request (OpenAI's limit)
MAX_LOGPROBS = 20     # top logprobs per token (the OpenAI API's limit)
