"""Structured outputs: a request's constraint (params.py) compiled by a grammar engine (grammar.py, xgrammar) into
a matcher per request that the engine advances token by token and that fills the sampler's token bitmask
(manager.py). The bitmask is applied to the logits on the device by runner/token_mask.py."""
