"""The checks of a model's image inputs (`model.vision` > 0; `Transformer.__call__`'s
`images` and `image_mask`, see moe_jax/model/transformer.py): clear errors for inputs that
cannot fill the positions the mask marks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_image_inputs(d_vision: int, batch_shape: tuple[int, int], images_BND, mask_BT) -> None:
    """Clear errors for image inputs that cannot fill the marked positions (ValueError)."""
    B, T = batch_shape
    if d_vision == 0:
        raise ValueError(
            "this model takes no image embeddings (model.vision=0); set model.vision to their "
            "width to train a model that does"
        )
    if images_BND is None or mask_BT is None:
        raise ValueError("images and image_mask go together: pass both or neither")
    if images_BND.ndim != 3 or images_BND.shape[0] != B or images_BND.shape[2] != d_vision:
        raise ValueError(
            f"images must be [B={B}, N, model.vision={d_vision}], got shape {images_BND.shape}"
        )
    if mask_BT.shape != (B, T) or mask_BT.dtype != jnp.bool_:
        raise ValueError(
            f"image_mask must be a boolean [B={B}, T={T}] array like the tokens, got "
            f"{mask_BT.dtype} {mask_BT.shape}"
        )
    N = images_BND.shape[1]
    if N > T:
        raise ValueError(f"{N} image embeddings per row cannot fill {T} token positions")
    try:
        counts_B = np.asarray(mask_BT).sum(axis=1)
    except jax.errors.TracerArrayConversionError:
        return  # traced under jit: the counts are the caller's contract (see the module doc)
    if np.any(counts_B != N):
        row = int(np.argmax(counts_B != N))
        raise ValueError(
            f"image_mask row {row} marks {counts_B[row]} positions but images holds {N} "
            "embeddings per row; mark exactly one position per image embedding in every row"
        )
