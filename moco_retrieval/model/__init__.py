"""The encoder and what builds, loads and copies it.

``encoder.py`` (heads, ``Tower``, ``TextEncoder``, ``build_encoder``), ``backbone.py`` (finding and
loading the Hugging Face backbone), ``decoder.py`` (decoder backbones), ``tiny.py`` (tiny test
backbones), ``feature_cache.py`` (frozen-backbone features), ``lora.py`` (LoRA adapters on a frozen
backbone), ``momentum.py`` (the EMA key encoder), ``gradcache.py`` (large contrastive batches in
chunks), ``loading.py`` (encoders from checkpoints, model directories and the base; the frozen
guide), ``devices.py``."""
