"""Limits the job file checks and the engine sizes its tensors by (a leaf: both import it)."""

MAX_LOGIT_BIAS = 300  # token ids with a bias, per request (OpenAI's limit)
MAX_LOGPROBS = 20     # top logprobs per token (the OpenAI API's limit)
# A shared head shorter than this is not shared (plan/heads.py): its rows would wait for the
# head's first row to prefill it (one step) to save less than one small chunk each, and every
# head stops a chunk and keeps a recurrent state. 64 tokens is also under any system prompt
# worth the name.
MIN_HEAD_TOKENS = 64
