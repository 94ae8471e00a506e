"""The fault suite and the randomized checker (``reliability/``)."""
