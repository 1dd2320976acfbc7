"""Built-in backends. Each module is a specops plugin registered through the ``specops`` entry points."""
