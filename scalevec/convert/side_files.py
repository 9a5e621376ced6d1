"""The non-weight files of an output folder: config.json, generation_config.json, the remote code of a ScaleVec
output, and the tokenizer files copied through from the source."""

import copy
import json
import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedConfig
from transformers.dynamic_module_utils import get_relative_import_files

from .. import modeling_scalevec
from ..configuration_scalevec import ScaleVecConfig
from .formats import Format, StockFormat
from .heads import CAUSAL_LM, Head

# What `save_pretrained` ships: the model file and every file it imports relatively, found as transformers finds them.
REMOTE_CODE = tuple(map(Path, [modeling_scalevec.__file__, *get_relative_import_files(modeling_scalevec.__file__)]))
# Copied through from the source: the tokenizer in any of its usual forms, and the chat template.
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "spiece.model",
    "*.tiktoken",
    "chat_template.*",
)


def write_config(
    folder: Path, target: Format, config: ScaleVecConfig, dtype: torch.dtype, head: Head = CAUSAL_LM
) -> None:
    """config.json of a `head` model as `save_pretrained` writes it, plus the legacy fields other readers need
    (stock targets) or the `auto_map` of the remote code (ScaleVec)."""
    architecture = target.architecture(head)
    if isinstance(target, StockFormat):
        stock = target.stock_config(config)
        content = _config_json(stock, architecture, dtype) | target.legacy_fields(stock)
    else:
        # As `ScaleVecPreTrainedModel.save_pretrained` records it: users load the base model too.
        content = _config_json(copy.deepcopy(config), architecture, dtype) | {"auto_map": modeling_scalevec.AUTO_MAP}
    (folder / "config.json").write_text(json.dumps(dict(sorted(content.items())), indent=2) + "\n")


def _config_json(config: PreTrainedConfig, architecture: str, dtype: torch.dtype) -> dict:
    config.architectures = [architecture]
    config.dtype = dtype
    # An output is for inference: the Trainer sets `use_cache=False` for training, which must not be copied through.
    config.use_cache = True
    return json.loads(config.to_json_string(use_diff=True))


def write_remote_code(folder: Path) -> None:
    for source in REMOTE_CODE:
        shutil.copyfile(source, folder / source.name)


def copy_side_files(source: Path, folder: Path, config: PreTrainedConfig) -> None:
    """Copy the tokenizer files and generation_config.json (or write one from `config`, as `save_pretrained`
    does)."""
    names = sorted({p.name for pattern in TOKENIZER_PATTERNS for p in source.glob(pattern) if p.is_file()})
    for name in names:
        shutil.copyfile(source / name, folder / name)
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", folder / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(folder)
