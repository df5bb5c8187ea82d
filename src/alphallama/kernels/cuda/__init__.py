"""CUDA C++ kernels compiled at run time with NVRTC (docs/design.md §8).

The .cu sources ship in the package; nvrtc.py compiles them through cuda-python
(cuda.bindings) for the GPU in use, caches the cubin per architecture and source hash in
the user's cache under the native library's ownership checks, and launches on torch's
current stream (so a captured CUDA graph holds the launch). Nothing here is imported by
the CPU path, and importing nvrtc.py itself needs neither a GPU nor cuda-python: those
are imported at the first compile or launch. schedule.py builds the persistent layer
kernel's (round_layer.cu) instruction queues on the host (plain Python, CPU-tested)."""
