"""The model: its catalog (importable without torch) and, later, the stage-sliceable transformer."""
