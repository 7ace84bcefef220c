"""Where image embeddings go when one image token of the text is replaced by the image's embeddings.

A sample's ``input_ids`` ``[t]`` hold one ``image_token_index`` per image; the combined sequence gives
that image ``num_tiles * img_seq_len`` positions and every text token one. :func:`splice_layout`
computes the text tokens' new positions and which positions hold image embeddings (samples shorter
than the longest are padded at the end); :func:`splice_embeddings` and :func:`splice_labels` fill the
combined embeddings ``[b, L, h]`` and the labels / loss mask ``[b, L]`` (LLaVA's ``_preprocess_data``).

Labels are next-token targets: the label at a position is the target of the token there. An image's
positions are never trained (``IGNORE_INDEX`` / loss mask 0) except that its last position predicts
the text token after it, and the text token just before an image does not predict the image.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class SpliceLayout:
    """Index tensors describing one batch's combined sequence (all built without gradients)."""

    image_token_mask: torch.Tensor  # [b, t] True at image tokens
    end_positions: torch.Tensor  # [b, t] last combined position of each input token
    text_batch: torch.Tensor  # [n_text] sample of each text token
    text_index: torch.Tensor  # [n_text] its index in input_ids
    text_position: torch.Tensor  # [n_text] its combined position
    image_mask: torch.Tensor  # [b, L] True at positions holding image embeddings
    seq_lens: torch.Tensor  # [b] combined length of each sample (without end padding)
    num_tiles: int  # tiles over the batch (image embeddings needed: num_tiles * img_seq_len)


def splice_layout(input_ids: torch.Tensor, image_token_index: int, num_image_tiles: torch.Tensor,
                  img_seq_len: int, min_length: int = 0) -> SpliceLayout:
    """The combined-sequence layout of ``input_ids`` ``[b, t]`` (length at least ``min_length``).

    ``num_image_tiles`` ``[num_images]`` gives each image's tile count, images in batch order.
    """
    with torch.no_grad():
        image_token_mask = input_ids == image_token_index
        images_per_sample = image_token_mask.sum(dim=-1)
        num_images = int(images_per_sample.sum())
        if num_image_tiles.dim() != 1 or num_image_tiles.shape[0] != num_images:
            raise ValueError(
                f"input_ids hold {num_images} image tokens (image_token_index={image_token_index}; per sample "
                f"{images_per_sample.tolist()}) but there are {num_image_tiles.numel()} images "
                f"(num_image_tiles={num_image_tiles.tolist()})"
            )
        if num_images and int(num_image_tiles.min()) < 1:
            raise ValueError(f"num_image_tiles ({num_image_tiles.tolist()}) must be >= 1 for every image")
        # Each token's width in the combined sequence: 1 for text, tiles * img_seq_len for an image.
        widths = torch.ones_like(input_ids)
        widths[image_token_mask] = num_image_tiles.to(widths.device, widths.dtype) * img_seq_len
        end_positions = widths.cumsum(dim=-1) - 1
        seq_lens = end_positions[:, -1] + 1
        length = max(int(seq_lens.max()), min_length)
        text_batch, text_index = torch.where(~image_token_mask)
        text_position = end_positions[text_batch, text_index]
        batch_size = input_ids.shape[0]
        image_mask = torch.arange(length, device=input_ids.device).expand(batch_size, length) < seq_lens[:, None]
        image_mask = image_mask.clone()
        image_mask[text_batch, text_position] = False
    return SpliceLayout(image_token_mask, end_positions, text_batch, text_index, text_position, image_mask,
                        seq_lens, int(num_image_tiles.sum()) if num_images else 0)


def splice_embeddings(layout: SpliceLayout, text_bth: torch.Tensor, image_sth: torch.Tensor,
                      img_seq_len: int) -> torch.Tensor:
    """Combined embeddings ``[b, L, h]`` from text ``[b, t, h]`` and image ``[img_seq_len, tiles, h]`` embeddings."""
    if layout.num_tiles and (image_sth.dim() != 3 or tuple(image_sth.shape[:2]) != (img_seq_len, layout.num_tiles)):
        raise ValueError(
            f"the text's image tokens need {layout.num_tiles} image tiles of {img_seq_len} embeddings "
            f"([{img_seq_len}, {layout.num_tiles}, h]), got image embeddings of shape {tuple(image_sth.shape)}"
        )
    if not layout.num_tiles and image_sth.numel():
        raise ValueError(f"input_ids hold no image token but image embeddings of shape {tuple(image_sth.shape)} "
                         "were given")
    batch_size, length = layout.image_mask.shape
    hidden = text_bth.shape[-1]
    combined = text_bth.new_zeros(batch_size, length, hidden)
    combined[layout.text_batch, layout.text_position] = text_bth[layout.text_batch, layout.text_index]
    if layout.num_tiles:
        # Tiles in batch order, each tile's embeddings in sequence order: the order of the True positions.
        combined[layout.image_mask] = image_sth.transpose(0, 1).reshape(-1, hidden).to(combined.dtype)
    return combined


def splice_labels(layout: SpliceLayout, labels: torch.Tensor,
                  loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and loss mask ``[b, L]`` from the text's ``[b, t]`` ones."""
    if labels.shape != loss_mask.shape or labels.shape != layout.end_positions.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} must both have "
                         f"the shape of input_ids {tuple(layout.end_positions.shape)}")
    batch_size, length = layout.image_mask.shape
    new_labels = labels.new_full((batch_size, length), IGNORE_INDEX)
    new_mask = loss_mask.new_zeros((batch_size, length))
    # A text token's target moves to the position before it: that position now precedes it.
    has_prev = layout.text_index > 0
    b, i, p = layout.text_batch[has_prev], layout.text_index[has_prev], layout.text_position[has_prev]
    new_labels[b, p - 1] = labels[b, i - 1]
    rows = torch.arange(batch_size, device=labels.device)
    new_labels[rows, layout.seq_lens - 1] = labels[:, -1]
    new_mask[layout.text_batch, layout.text_position] = loss_mask[layout.text_batch, layout.text_index]
    new_mask[layout.image_mask] = 0
    # The text token right before an image would have to predict an image embedding: not trained.
    img_b, img_i = torch.where(layout.image_token_mask)
    before = img_i > 0
    new_mask[img_b[before], layout.end_positions[img_b[before], img_i[before] - 1]] = 0
    return new_labels, new_mask
