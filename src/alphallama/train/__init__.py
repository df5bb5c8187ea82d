"""Training the embedded default model (a small qwen3moe with an MTP head) and MTP heads.

Run as `python -m alphallama.train --help`; see README.md ("Training the embedded model").
Needs only the base dependencies (torch, numpy, gguf, tokenizers); `pip install -e '.[train]'`
adds matplotlib for the training-curve plot.
"""
