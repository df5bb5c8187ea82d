"""Speculative decoding: drafters propose, one verify pass over W rows decides."""
