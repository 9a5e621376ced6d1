"""The published folder on the oldest transformers it supports (what vLLM's CPU release pins), in a second
environment built from the package index with no `scalevec` in it: folded dense and MoE checkpoints with trained
scales give the newest transformers' logits and greedy tokens; an older release gets one clear version message.

The environment needs the package index once (it is cached); offline, deselect these tests with
`-m "not old_transformers"`.
"""

import os
import subprocess
import venv
from pathlib import Path

import pytest
import torch

from scalevec.configuration_scalevec import MINIMUM_TRANSFORMERS
from scalevec.convert import fold_checkpoint

from ._helpers import SUBPROCESS_ENV, random_ids, saved_scalevec, tiny_config, tiny_moe_config

pytestmark = [pytest.mark.slow, pytest.mark.old_transformers]  # it starts processes or trains end to end
OLDEST = ".".join(map(str, MINIMUM_TRANSFORMERS))
ENVIRONMENTS = Path(os.environ.get("SCALEVEC_TEST_ENVS", Path.home() / ".cache" / "scalevec-test-envs"))

LOAD = """
import sys, torch
sys.modules["scalevec"] = None  # the folder's own code, not the package
import transformers
from transformers import AutoModelForCausalLM
folder, version = sys.argv[1], sys.argv[2]
if version:
    transformers.__version__ = version  # as an older release reports itself
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.load(folder + "/ids.pt", weights_only=True)
with torch.no_grad():
    logits = model(ids).logits
tokens = model.generate(ids[:, :4], max_new_tokens=6, do_sample=False)
torch.save({"version": transformers.__version__, "logits": logits, "tokens": tokens}, folder + "/old.pt")
"""


@pytest.fixture(scope="session")
def old_python() -> Path:
    """Python of a venv with transformers OLDEST.* and the torch of this one (CPU build where that is installed)."""
    folder = ENVIRONMENTS / f"transformers-{OLDEST}-torch-{torch.__version__}"
    python = folder / "bin" / "python"
    if not (folder / "ready").exists():
        venv.create(folder, with_pip=True, clear=True)
        torch_requirement = f"torch=={torch.__version__.split('+')[0]}"
        command = [str(python), "-m", "pip", "install", "-q", torch_requirement, f"transformers=={OLDEST}.*"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, (
            f"could not build the transformers {OLDEST} environment:\n{result.stderr[-3000:]}"
        )
        (folder / "ready").touch()
    return python


def run_old(python: Path, folder: Path, version: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, **SUBPROCESS_ENV, "HF_HOME": str(folder.parent / "hf_home"), "PYTHONPATH": ""}
    command = [str(python), "-c", LOAD, str(folder), version]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=folder)


@pytest.mark.parametrize("moe", [False, True])
def test_folded_folder_on_the_oldest_transformers_gives_the_newest_logits(moe, old_python, tmp_path):
    config = tiny_moe_config() if moe else tiny_config(qk_norm=True)
    saved_scalevec(tmp_path / "trained", config)
    fold_checkpoint(tmp_path / "trained", tmp_path / "folded")
    folder = tmp_path / "folded"
    ids = random_ids(config)
    torch.save(ids, folder / "ids.pt")
    newest = ScaleVecFolder(folder)

    result = run_old(old_python, folder)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[ERROR]" not in result.stderr  # e.g. an undocumented argument for that release's auto_docstring
    old = torch.load(folder / "old.pt", weights_only=True)
    assert old["version"].startswith(OLDEST)
    torch.testing.assert_close(old["logits"], newest.logits(ids), atol=1e-4, rtol=0)
    assert torch.equal(old["tokens"], newest.generate(ids[:, :4]))


def test_an_older_release_gets_one_message_naming_both_versions(old_python, tmp_path):
    saved_scalevec(tmp_path / "trained", tiny_config())
    fold_checkpoint(tmp_path / "trained", tmp_path / "folded")
    result = run_old(old_python, tmp_path / "folded", version="5.18.2")
    assert result.returncode != 0
    message = f"ScaleVec's model code needs transformers >= {OLDEST}; this environment has transformers 5.18.2"
    assert message in result.stderr


class ScaleVecFolder:
    """The folder loaded in this process, on the newest transformers."""

    def __init__(self, folder: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(ids).logits

    def generate(self, prompt: torch.Tensor) -> torch.Tensor:
        return self.model.generate(prompt, max_new_tokens=6, do_sample=False)
