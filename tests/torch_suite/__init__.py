"""torch's own distributed test suite, run against gloo and against ringcomm (``run.py``)."""
