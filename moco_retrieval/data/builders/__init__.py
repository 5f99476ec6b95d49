"""Built-in data sets: Debian package descriptions, the Python standard library's docstrings."""
