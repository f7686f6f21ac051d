"""The MoE decoder in Flax NNX (see transformer.py for the call contract).

Shape letters. An array's name ends in its axes, one capital each (`x_BTD`: batch, positions,
model width); a module whose letters mean something else here says so in its docstring.

    B  batch rows (sequences)           T  the queries' positions (this call's tokens)
    S  the keys' (the cache's) positions; an expert buffer's segments (routing groups, x_ESCD)
    D  model width (d_model); a head's width where heads are axes of their own (q_BKMD)
    V  vocabulary                       H  query heads
    K  key/value heads (GQA); a weight's contracted input axis (w_EKN)
    G  query heads per key/value head (H = K x G)
    M  the query rows one attention kernel call takes; a page table's pages (table_BM)
    Q  an MLA query/key head's width (rope + nope)
    R  MLA's latent rank (c_BTR); an expert's rows (rows_ER)
    L  layers (load_SLE); MLA's compressed key/value width (kv_BTL)
    E  experts                          C  an expert buffer's slots (its capacity)
    F  an expert's (or the dense FFN's) hidden width
    N  a weight's output axis (w_EKN); images (images_BND); pages (pages_NPKD)
    P  prompt positions (prompt_BP); a page's slots (pages_NPKD); peer shards (send_PE)
    J  rows of any leading shape, flattened (x_JD)
    W  a sliding window's ring of positions
    X  whatever trails (a_RX)           A  micro-batches (gradient accumulation)

A lower-case letter is a size that varies by call (x_nK: n rows).
"""

from moe_jax.model.transformer import Transformer

__all__ = ["Transformer"]
