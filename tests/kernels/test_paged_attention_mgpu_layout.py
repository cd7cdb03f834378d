"""How a Mosaic GPU launch's work is cut (kernels/mosaic/layout.py): the query tiles of a
ragged batch, the tiles of one token, the one-token rows of a prefill launch, and a split launch's
(tile, split) items, on small hand-checked batches."""

import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.mosaic.layout import one_token_layout, tile_layout, token_layout, work_list


def test_tile_layout():
    """Tiles of 4 tokens: sequence i's first tile is cu[i] // 4 + i; an empty sequence owns none; the
    padding tokens are tiled as one more sequence, whose tiles have no sequence but have tokens."""
    cu = jnp.array([0, 1, 7, 7, 9], jnp.int32)
    kv = jnp.array([5, 6, 3, 12], jnp.int32)
    meta, tile_of = tile_layout(cu, kv, 11, 4)
    assert meta.shape == (3 + 4, 4)
    seq, pos0, kv_end, tok0 = np.asarray(meta).T
    np.testing.assert_array_equal(seq, [0, 1, 1, -1, 3, -1, -1])
    np.testing.assert_array_equal((kv_end - pos0)[[0, 1, 2, 4, 6]], [1, 4, 2, 2, 2])  # its tokens
    np.testing.assert_array_equal((kv_end - pos0)[[3, 5]], [0, 0])  # unowned
    np.testing.assert_array_equal(tok0[[0, 1, 2, 4, 6]], [0, 1, 5, 7, 9])
    np.testing.assert_array_equal(pos0[[0, 1, 2, 4]], [4, 0, 4, 10])
    np.testing.assert_array_equal(kv_end[[0, 1, 2, 4]], [5, 4, 6, 12])
    np.testing.assert_array_equal(np.asarray(tile_of), [0, 1, 1, 1, 1, 2, 2, 4, 4, 6, 6])


def test_work_list():
    """A split launch's items: each owned tile's splits that have keys (KV tiles of 8 split 4 ways, a
    ``cdiv(num_kv, 4)`` share each), tile by tile, their count first; unowned tiles have none."""
    cu = jnp.array([0, 1, 7, 7, 9], jnp.int32)
    kv = jnp.array([5, 6, 3, 40], jnp.int32)  # KV tiles of its tiles: 1; 1, 1; none; 5 (shares of 2, 2, 1)
    meta, _ = tile_layout(cu, kv, 11, 4)  # tiles 3, 5 unowned, 6 the padding tokens'
    work = np.asarray(work_list(meta, 8, 4))
    assert work.shape == (7 * 4 + 1, 2) and work[0, 0] == 6
    np.testing.assert_array_equal(work[1:7], [[0, 0], [1, 0], [2, 0], [4, 0], [4, 1], [4, 2]])
    assert not work[7:].any()


def test_token_layout():
    """Decode launches have a tile per token: tile t is token t, padding tokens unowned. The decode rows of
    a prefill launch have a tile per sequence, owned where it has one new token, which it names."""
    cu, kv = jnp.array([0, 1, 1, 3], jnp.int32), jnp.array([5, 2, 9], jnp.int32)
    meta = np.asarray(token_layout(cu, kv, 5))
    np.testing.assert_array_equal(meta[:3], [[0, 4, 5], [2, 7, 8], [2, 8, 9]])  # (sequence, position, kv_end)
    np.testing.assert_array_equal(meta[3:, 0], [-1, -1])
    meta = np.asarray(one_token_layout(cu, kv))
    np.testing.assert_array_equal(meta[:, 0], [0, -1, -1])
    np.testing.assert_array_equal(meta[0], [0, 4, 5, 0])  # (sequence, position, kv_end, token)
