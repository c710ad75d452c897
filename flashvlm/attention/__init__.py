from flashvlm.attention.base import AttentionBackend, AttentionMetadata, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
