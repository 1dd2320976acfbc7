"""Built-in backends. Each module is a specops plugin registered through the ``specops`` entry points."""

#: The backend of `specops resolve TARGET` and `specops advise` when neither a profile nor --backend names one.
DEFAULT_BACKEND = "vllm"
