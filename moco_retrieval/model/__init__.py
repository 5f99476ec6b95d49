"""Encoders (``encoder.py``), the tiny test backbone (``tiny.py``)."""
