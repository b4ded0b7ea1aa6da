"""The reference LLM server: a batch-invariant engine behind a fault-tolerant router.

- ``model``: a small byte-level GPT with seeded weights, reading a paged KV pool;
- ``kvcache``: the block pool, prefix cache (chained block hashes) and block checksums;
- ``engine``: continuous batching with greedy, batch-invariant decoding (``Engine``,
  ``generate``, the ground truth);
- ``worker``, ``router``, ``server``, ``journal``: the processes around the engine.

Importing this package is cheap: torch is imported only by the submodules.
"""
