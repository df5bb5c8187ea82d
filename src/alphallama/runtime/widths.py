"""The round widths: one CUDA graph per bucket, a round of W rows in the smallest that holds it."""
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
MAX_W = BUCKETS[-1]


def bucket_of(w: int) -> int:
    return next(b for b in BUCKETS if b >= w)
