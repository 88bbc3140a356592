"""The model: its catalog and dimensions (importable without torch), the stage-sliceable transformer
(``transformer``, imports torch), the training corpus (``corpus``, pure); which stage a peer moves to at runtime is
``heal.rebalance``."""
