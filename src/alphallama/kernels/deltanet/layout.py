"""The recurrent cache's row counts (no Triton: the plan sizes a hybrid's cache from them on a
machine without a GPU): a round's rows and the conv ring's."""

W_MAX = 64
RING_ROWS = 72     # >= W_MAX + d_conv - 1 = 64 + 3: a round's reads and writes never share a slot
