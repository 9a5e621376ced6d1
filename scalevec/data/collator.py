"""Batches of packed blocks for the Trainer."""

from dataclasses import dataclass

import numpy as np
import torch


def document_positions(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Each token's position in its document: counting restarts after every end-of-text token (a document's last
    token) and at the start of every row, so a document cut by a block boundary continues as one of its own."""
    index = torch.arange(input_ids.shape[-1]).expand_as(input_ids)
    starts = torch.ones_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_token_id
    return index - torch.where(starts, index, 0).cummax(dim=-1).values


@dataclass
class PackedBlockCollator:
    """Stacks packed blocks into `input_ids` and `labels`. With `document_masking` it adds `position_ids` that
    restart at every document and no attention mask: transformers' padding-free path, in which restarting
    positions make the attention block-diagonal, one block per document (the mask is built from the position ids
    by `create_causal_mask` for eager, sdpa and flex attention). Flash attention finds packed documents only in a
    batch of one row, so `flatten` lays the blocks end to end in one row.

    `labels` is `input_ids` itself, not a copy (at 32 x 2048 the copy was most of the time a batch took): the loss
    shifts the labels into a new tensor and changes neither. Only `flatten`, which masks labels, gets a copy."""

    eos_token_id: int
    document_masking: bool = False
    flatten: bool = False

    def __call__(self, blocks: list[dict]) -> dict[str, torch.Tensor]:
        input_ids = torch.from_numpy(np.stack([block["input_ids"] for block in blocks], dtype=np.int64))
        batch = {"input_ids": input_ids, "labels": input_ids}
        if not self.document_masking:
            return batch
        batch["position_ids"] = document_positions(input_ids, self.eos_token_id)
        if self.flatten:
            # In one row a block's last token would learn to predict the next block's first token.
            batch["labels"] = input_ids.clone()
            batch["labels"][:, 0] = -100
            batch = {key: value.reshape(1, -1) for key, value in batch.items()}
        return batch
