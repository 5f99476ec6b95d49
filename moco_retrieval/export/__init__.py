"""Export: a trained encoder as a sentence-transformers model directory with its model card (and
its ONNX / int8 forms).

``python -m moco_retrieval.export``: __main__.py; the files: writer.py; out_dir's rules: folder.py;
the card: card.py."""
