"""The encoder and its parts: ``backbone.py`` (finding and loading the Hugging Face backbone),
``feature_cache.py`` (frozen-backbone features), ``encoder.py`` (heads, ``Tower``, ``TextEncoder``,
``build_encoder``), ``lora.py`` (LoRA adapters on a frozen backbone), ``decoder.py`` (last-token
pooling and the end-of-text token of decoder backbones), ``momentum.py`` (the EMA key encoder,
``state_dict_prefix``), ``queue.py`` (the MoCo negative queue), ``loading.py`` (encoders from
checkpoints and model directories), ``tiny.py`` (the tiny test backbones: BERT, Llama, Qwen2)."""
