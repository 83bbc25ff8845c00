"""The Hugging Face export of a trust_remote_code model reloads with from_pretrained.

The weights here come from ``save_pretrained`` of the loaded custom model, the same call
``TrainerGroup.export_hf`` ends in; what is under test is that every remote-code artifact the
export needs is carried over (seed 002), and that a missing one fails loudly."""

import json
import shutil

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
    from kuberl.driver.tiny import make_model

    source = make_model(tmp_path / "tiny")
    (tmp_path / "export").mkdir()
    assert copy_remote_code(source, tmp_path / "export") == []


def _export(model, source, tmp_path, out_dir, *, trust_remote_code: bool) -> str:
    """What rank 0 does in TrainerActor.export_hugging_face: the trainer writes the model (here
    ``save_pretrained`` stands in for the FSDP gather, which ends in it), then publish_export adds
    the remote code and uploads to the checkpoint root's ``hf/``."""
    from kuberl.train.export import publish_export

    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    return publish_export(out_dir, source, str(tmp_path / "ckpt" / "hf"), trust_remote_code=trust_remote_code)


def test_export_without_trust_remote_code_copies_no_python_and_does_not_fail(tmp_path):
    """The stager left the .py files out (trustRemoteCode is off), but config.json still carries
    the repository's auto_map: the export must neither fail after the last step nor copy code."""
    from kuberl.driver.tiny import make_model

    source = make_model(tmp_path / "staged")
    config = json.loads((source / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (source / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(source)
    where = _export(model, source, tmp_path, tmp_path / "export", trust_remote_code=False)
    assert where == f"{tmp_path / 'ckpt'}/hf"
    assert not list((tmp_path / "ckpt" / "hf").glob("*.py"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "hf") is not None

    # The same directory with remote code present: still nothing copied while trust is off.
    (source / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    _export(model, source, tmp_path, tmp_path / "export", trust_remote_code=False)
    assert not list((tmp_path / "export").glob("*.py"))


@pytest.mark.parametrize("entry", ["../outside.Evil", "sub/../../outside.Evil", "/etc/passwd.x",
                                   "..", "a.b.Class", "modeling_tiny_custom.Class; rm"])
def test_auto_map_entries_are_module_names_never_paths(tmp_path, entry):

    source = tmp_path / "models" / "source"
    source.parent.mkdir()
    model = _write_custom_model(source)
    (tmp_path / "models" / "outside.py").write_text("secret = 1\n")
    config = json.loads((source / "config.json").read_text())
    config["auto_map"]["AutoTokenizer"] = [entry, None]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="is not module.Class with a Python module name"):
        _export(model, source, tmp_path, tmp_path / "out" / "export", trust_remote_code=True)
    assert not (tmp_path / "out" / "outside.py").exists() and not (tmp_path / "ckpt").exists()


def test_export_with_trust_remote_code_reloads(tmp_path):

    source = tmp_path / "source"
    model = _write_custom_model(source)
    _export(model, source, tmp_path, tmp_path / "export", trust_remote_code=True)
    exported = tmp_path / "ckpt" / "hf"
    assert sorted(p.name for p in exported.glob("*.py")) == ["configuration_tiny_custom.py", "layers_tiny_custom.py",
                                                             "modeling_tiny_custom.py"]
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)(ids).logits,
                       model(ids).logits)
