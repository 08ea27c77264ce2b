"""The paged KV cache: blocks, prefix sharing, addressing, its audit, device residency."""
