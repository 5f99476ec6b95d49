"""Contrastive objectives: ``loss, stats = objective(batch, embed)`` (base.py), each asking the module
for the embeddings it needs. The core: InfoNCE in blocks with false negatives masked (infonce.py)
and key memories (memory.py); the objectives (inbatch, moco, two_queue, feature_memory) by name in
registry.py; optional parts that plug in or wrap: guided masking, logQ, refresh, Matryoshka."""
