"""What every draft head is built from: the `DraftHead` interface and `HeadConfig` (`base`), the
decoder layer, norms and RoPE (`layers`), the reduced draft vocabulary (`vocab`), starting a layer
from the target's (`target_layer`) and int8 decoding copies (`quantize`).

Each algorithm's own head lives with the algorithm (`eagle.algorithms.<name>.head`); building,
saving and loading a head by its algorithm name is `eagle.algorithms.head_io`.
"""

from eagle.heads.base import DraftHead, HeadConfig

__all__ = ["DraftHead", "HeadConfig"]
