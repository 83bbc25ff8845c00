"""The Hugging Face export of a trust_remote_code model reloads with from_pretrained.

The weights here come from ``save_pretrained`` of the loaded custom model, the same call
``TrainerGroup.export_hf`` ends in; what is under test is that every remote-code artifact the
export needs is carried over (seed 002), and that a missing one fails loudly."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kuberl.train.export import ExportError, copy_remote_code

CONFIG_PY = '''
from transformers import PretrainedConfig


class TinyCustomConfig(PretrainedConfig):
    model_type = "tiny_custom"

    def __init__(self, vocab_size=32, hidden_size=16, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        super().__init__(**kwargs)
'''

MODELING_PY = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_custom import TinyCustomConfig
from .layers_tiny_custom import Mixer


class TinyCustomForCausalLM(PreTrainedModel):
    config_class = TinyCustomConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.mixer = Mixer(config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, **kwargs):
        return CausalLMOutput(logits=self.head(self.mixer(self.embed(input_ids))))
'''

LAYERS_PY = '''
import torch


class Mixer(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return torch.tanh(self.proj(x))
'''


def _write_custom_model(path):
    path.mkdir()
    (path / "configuration_tiny_custom.py").write_text(CONFIG_PY)
    (path / "modeling_tiny_custom.py").write_text(MODELING_PY)
    (path / "layers_tiny_custom.py").write_text(LAYERS_PY)
    (path / "config.json").write_text(json.dumps({
        "model_type": "tiny_custom", "vocab_size": 32, "hidden_size": 16,
        "architectures": ["TinyCustomForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_tiny_custom.TinyCustomConfig",
                     "AutoModelForCausalLM": "modeling_tiny_custom.TinyCustomForCausalLM"},
    }))
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(path)
    return model


def test_export_of_remote_code_model_reloads(tmp_path):
    source = tmp_path / "source"
    model = _write_custom_model(source)
    export = tmp_path / "export"
    model.save_pretrained(export)
    # save_pretrained copies only the files of the classes it saw; the relative import
    # (layers_tiny_custom.py) is what a naive export loses.
    (export / "layers_tiny_custom.py").unlink(missing_ok=True)
    copied = copy_remote_code(source, export)
    assert copied == ["configuration_tiny_custom.py", "layers_tiny_custom.py", "modeling_tiny_custom.py"]
    reloaded = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(reloaded(ids).logits, model(ids).logits)
    assert AutoConfig.from_pretrained(export, trust_remote_code=True).model_type == "tiny_custom"


def test_missing_remote_code_fails_loudly(tmp_path):
    source = tmp_path / "source"
    _write_custom_model(source)
    (source / "layers_tiny_custom.py").unlink()
    (tmp_path / "export").mkdir()
    with pytest.raises(ExportError, match="needs layers_tiny_custom.py"):
        copy_remote_code(source, tmp_path / "export")


def test_plain_model_needs_no_remote_code(tmp_path):
    from kuberl.tiny import make_model

    source = make_model(tmp_path / "tiny")
    (tmp_path / "export").mkdir()
    assert copy_remote_code(source, tmp_path / "export") == []
