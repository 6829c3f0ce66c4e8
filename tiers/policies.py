"""Eviction policies beyond LRU (ARC, S3-FIFO) and admission wrappers; registered on import."""
