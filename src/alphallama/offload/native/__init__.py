"""CPU expert workers: the expert contract (kernels/moe/expert_q8.py) in C, built at first use
(build.py), a pool of pinned threads serving the mailbox (workers.py), and the probe that
sizes the pool to the host's memory bandwidth (probe.py)."""
