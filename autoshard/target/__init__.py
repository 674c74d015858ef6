"""Resolve what the user has into a buildable target: ``"file.py:callable"`` strings
(:mod:`.resolve`), model objects, Hugging Face and Lightning modules (:mod:`.adapters`, the one
place a model is adapted), and one training step's batch and loss (:mod:`.step`)."""
