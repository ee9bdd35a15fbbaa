"""Bounds that the gateway enforces on requests and the services rely on.

Owns: the numbers both sides must agree on. Does not own: where each is checked.
"""

from __future__ import annotations

# The widest top-k of logprobs a sample request may ask for, per prompt or sampled position
# (vLLM's default max_logprobs, so both sampling engines can serve it).
MAX_TOPK_LOGPROBS = 20
