"""The splice of image embeddings into the text, ``pixel_shuffle`` and the SP/CP padding helpers, against
expectations written out by hand (and, for the pure functions, Megatron-Core's own)."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_core.models.multimodal.context_parallel import get_packed_seq_params, get_padding
from megatron_core.models.multimodal.llava_model import IGNORE_INDEX, pixel_shuffle
from tests.models.multimodal.llava_fixture import HIDDEN, IMAGE_TOKEN_ID, build

IM, X = IMAGE_TOKEN_ID, IGNORE_INDEX


def test_embeddings_labels_and_loss_mask_expansion():
    """Sample 0: one 1-tile image in the middle; sample 1: a 2-tile image first and a 1-tile image later.

    With 3 embeddings per tile, sample 0 is 7 positions long (padded to 12) and sample 1 is 12.
    """
    model = build()
    model.img_seq_len = 3
    ids = torch.tensor([[10, 11, IM, 12, 13], [IM, 20, 21, IM, 22]])
    labels = torch.tensor([[11, IM, 12, 13, 14], [20, 21, IM, 22, 23]])
    loss_mask = torch.tensor([[1.0, 1, 1, 1, 1], [1, 1, 0, 1, 1]])
    tiles = torch.tensor([1, 2, 1])
    text = torch.randn(2, 5, HIDDEN)
    image = torch.randn(3, 4, HIDDEN)  # [img_seq_len, tiles, h]: tile 0 (sample 0), tiles 1-2, tile 3 (sample 1)

    combined, new_labels, new_mask = model._preprocess_data(image, text, ids, loss_mask, labels, False, None, IM,
                                                            tiles)

    zero = torch.zeros(HIDDEN)
    want0 = [text[0, 0], text[0, 1], *image[:, 0], text[0, 3], text[0, 4]] + [zero] * 5
    want1 = [*image[:, 1], *image[:, 2], text[1, 1], text[1, 2], *image[:, 3], text[1, 4]]
    assert combined.shape == (12, 2, HIDDEN)  # [L, b, h]
    torch.testing.assert_close(combined[:, 0], torch.stack(want0), rtol=0, atol=0)
    torch.testing.assert_close(combined[:, 1], torch.stack(want1), rtol=0, atol=0)
    assert new_labels.tolist() == [[11, X, X, X, 12, 13, 14, X, X, X, X, X],
                                   [X, X, X, X, X, 20, 21, X, X, X, 22, 23]]
    assert new_mask.tolist() == [[1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
                                 [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]]


def test_truncated_to_the_language_max_sequence_length():
    model = build()
    model.img_seq_len = 3
    model._language_max_sequence_length = 6
    ids = torch.tensor([[10, 11, IM, 12, 13]])
    labels, loss_mask = torch.tensor([[11, IM, 12, 13, 14]]), torch.ones(1, 5)
    combined, new_labels, new_mask = model._preprocess_data(
        torch.randn(3, 1, HIDDEN), torch.randn(1, 5, HIDDEN), ids, loss_mask, labels, False, None, IM, torch.ones(1))
    assert combined.shape == (6, 1, HIDDEN)
    assert new_labels.tolist() == [[11, X, X, X, 12, 13]] and new_mask.tolist() == [[1, 0, 0, 0, 0, 1]]


def test_image_embeddings_of_the_wrong_size_are_named():
    model = build()
    model.img_seq_len = 3
    ids = torch.tensor([[10, IM, 12]])
    with pytest.raises(ValueError, match=r"need 2 image tiles of 3 embeddings \(\[3, 2, h\]\), got image embeddings "
                                         r"of shape \(3, 1, 64\)"):
        model._preprocess_data(torch.randn(3, 1, HIDDEN), torch.randn(1, 3, HIDDEN), ids, None, None, False, None, IM,
                               torch.tensor([2]))


def _reference_shuffle(x: torch.Tensor, version: int) -> torch.Tensor:
    """Loops: block (r, c) of 2x2 patches -> patches (2r,2c), (2r,2c+1), (2r+1,2c), (2r+1,2c+1) concatenated."""
    n, tokens, c = x.shape
    side = int(tokens ** 0.5)
    grid = x.reshape(n, side, side, c)
    cells = [(r, q) for r in range(side // 2) for q in range(side // 2)]
    if version == 1:
        cells = [(r, q) for q in range(side // 2) for r in range(side // 2)]
    out = [torch.cat([grid[:, 2 * r + dr, 2 * q + dq] for dr in (0, 1) for dq in (0, 1)], dim=-1) for r, q in cells]
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("version", [1, 2])
def test_pixel_shuffle_against_loops(version):
    x = torch.randn(3, 36, 5)
    torch.testing.assert_close(pixel_shuffle(x, version=version), _reference_shuffle(x, version), rtol=0, atol=0)
    small = torch.arange(16.0).reshape(1, 16, 1)
    rows = {2: [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]],
            1: [[0, 1, 4, 5], [8, 9, 12, 13], [2, 3, 6, 7], [10, 11, 14, 15]]}[version]
    assert pixel_shuffle(small, version=version)[0].tolist() == rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pytest.importorskip("megatron.core.models.multimodal.llava_model").pixel_shuffle
    torch.testing.assert_close(pixel_shuffle(x, version=version), theirs(x, version=version), rtol=0, atol=0)


def test_pixel_shuffle_explicit_grid_merges_consecutive_tokens():
    x = torch.arange(24.0).reshape(1, 8, 3)
    out = pixel_shuffle(x, h=2, w=4)
    assert out.shape == (1, 2, 12) and out[0, 1].tolist() == list(range(12, 24))
    with pytest.raises(ValueError, match=r"h \(3\) and w \(4\) must both be given, with h\*w equal to the 8 tokens"):
        pixel_shuffle(x, h=3, w=4)
    with pytest.raises(ValueError, match=r"12 tokens are not a square grid whose side is a multiple of 2"):
        pixel_shuffle(torch.randn(1, 12, 3))


@pytest.mark.parametrize(("args", "kwargs", "expected"), [
    ((10, 1, 2, True), {}, 0),
    ((11, 1, 4, True), {}, 1),  # SP: multiple of tp
    ((11, 2, 1, False), {}, 1),  # CP: multiple of 2 * cp
    ((11, 2, 2, True), {}, 5),  # SP + CP: multiple of 2 * cp * tp
    ((11, 1, 1, False), dict(fp8_enabled=True), 5),
    ((11, 1, 1, False), dict(fp8_enabled=True, fp8_recipe="mxfp8"), 21),
    ((11, 1, 2, True), dict(fp8_enabled=True), 1),  # SP wins over FP8
    ((11, 1, 2, True), dict(decoder_tp_comm_overlap=True, decoder_seq_len=16), 5),
    ((11, 1, 1, False), {}, 0),
])
def test_get_padding(args, kwargs, expected):
    assert get_padding(*args, **kwargs) == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pytest.importorskip("megatron.core.models.multimodal.context_parallel").get_padding
    assert theirs(*args, **kwargs) == expected


def test_get_padding_bad_arguments():
    with pytest.raises(ValueError, match="decoder_seq_len is required"):
        get_padding(11, 1, 2, True, decoder_tp_comm_overlap=True)
    with pytest.raises(ValueError, match=r"seq_len \(20\) exceeds decoder_seq_len \(16\)"):
        get_padding(20, 1, 2, True, decoder_tp_comm_overlap=True, decoder_seq_len=16)


def test_get_packed_seq_params():
    tokens = torch.zeros(2, 6, dtype=torch.long)
    params = get_packed_seq_params(tokens, img_seq_len=4, padding_needed=2, cp_size=2)
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 10
    assert params.cu_seqlens_q.tolist() == [0, 8, 16] and params.cu_seqlens_q_padded.tolist() == [0, 10, 20]
    plain = get_packed_seq_params(tokens, img_seq_len=4, padding_needed=0, cp_size=1)
    assert plain.qkv_format == "sbhd" and plain.cu_seqlens_kv.tolist() == [0, 10, 20]
    assert plain.cu_seqlens_q_padded is None and plain.cu_seqlens_q.dtype == torch.int32
