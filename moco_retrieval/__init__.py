"""moco-retrieval: train dense-retrieval embedding models with a MoCo negative queue."""

__version__ = "0.1.0"
