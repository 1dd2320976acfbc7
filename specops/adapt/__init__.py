"""``specops adapt``: keep a sample of the traffic, train a draft on it, certify it, write it into the profile.

The control plane's part (capture, datasets, planning, promotion) never imports torch: the training itself
runs in the engine's venv as a subprocess (:mod:`specops.adapt.train_worker` for a llama.cpp GGUF draft,
:mod:`specops.adapt.eagle3_worker` for a vLLM EAGLE-3 head; each imported only there).
"""
