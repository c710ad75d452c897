"""Visual-token pruning strategies: given one image's merged embeddings and its token grid, choose which tokens
the language model sees (`base.py` holds the contract, `registry.py` the names). Nothing is imported here, so
`config.py` and the input processor can read the names and `kept_count` without importing torch."""
