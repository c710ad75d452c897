from flashvlm.attention.base import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionMetadata,
    AttentionStep,
    GraphAttentionBuffers,
    get_backend,
)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "AttentionStep", "GraphAttentionBuffers",
           "get_backend"]
