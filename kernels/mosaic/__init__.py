"""Paged attention on Pallas' Mosaic GPU backend (Hopper): ``attention.paged_attention_mgpu`` is the entry
point; ``tiles``, ``prefill`` and ``decode`` are its kernels, ``common``, ``fp8`` and ``layout`` what they
share. Importing this package imports nothing of Mosaic GPU: its modules do."""
