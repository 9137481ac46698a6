"""Memory arenas: where pages' bytes live. Only cuda.py imports cupy."""
