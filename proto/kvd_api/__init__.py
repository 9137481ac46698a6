"""The kvd.v1 API: the .proto source and its generated Python code (see generate.py)."""
