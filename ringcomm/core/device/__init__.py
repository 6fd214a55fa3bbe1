"""Device memory: the runtime seam (``runtime``), its CuPy and strict fake implementations,
and the kinds of device arrays the communicator accepts."""
