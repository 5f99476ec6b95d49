"""The encoder and its parts: ``backbone.py`` (finding and loading the Hugging Face backbone),
``feature_cache.py`` (frozen-backbone features), ``encoder.py`` (heads, ``Tower``, ``TextEncoder``,
``build_encoder``), ``momentum.py`` (the EMA key encoder, ``state_dict_prefix``), ``queue.py`` (the
MoCo negative queue), ``loading.py`` (encoders from checkpoints and model directories), ``tiny.py``
(the tiny test backbone)."""
