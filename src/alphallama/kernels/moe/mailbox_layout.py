"""The CPU-tier mailbox's control words (int32, each on its own 64-byte line), as the
GPU's combine kernel (moe_q8) and the CPU workers (offload/native) read them; the
mailbox itself is offload/mailbox.py."""
REQ, LAYER, ROWS, DONE, STOP, ERR = 0, 1, 2, 16, 32, 40
CTL_WORDS = 48
