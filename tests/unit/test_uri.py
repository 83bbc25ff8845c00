import pytest

from kuberl.api.uri import URIError, parse


@pytest.mark.parametrize("uri,scheme,bucket,path,revision", [
    ("s3://models/qwen/7b/", "s3", "models", "qwen/7b", None),
    ("gs://my-bucket", "gs", "my-bucket", "", None),
    ("hf://Qwen/Qwen3-30B-A3B@v1.0", "hf", "Qwen/Qwen3-30B-A3B", "", "v1.0"),
    ("Qwen/Qwen2.5-1.5B-Instruct", "hf", "Qwen/Qwen2.5-1.5B-Instruct", "", None),
    ("gpt2", "hf", "gpt2", "", None),
    ("pvc://model-store/qwen", "pvc", "model-store", "qwen", None),
    ("/opt/kuberl/tiny/model", "file", "", "/opt/kuberl/tiny/model", None),
])
def test_accepted_forms(uri, scheme, bucket, path, revision):
    parsed = parse(uri)
    assert (parsed.scheme, parsed.bucket, parsed.path, parsed.revision) == (scheme, bucket, path, revision)
    assert parsed.original == uri


@pytest.mark.parametrize("uri,needle", [
    ("", "non-empty"),
    ("ftp://host/x", "unknown scheme 'ftp://'"),
    ("s3://A_B/x", "valid bucket"),
    ("s3://bucket/a/../b", "'..'"),
    ("/data/../etc/passwd", "'..'"),
    ("pvc://Claim/x", "claim name"),
    ("./relative", "neither an absolute path"),
    ("s3://bucket/a b", "whitespace"),
])
def test_rejected_forms_name_the_field(uri, needle):
    with pytest.raises(URIError) as info:
        parse(uri, "spec.model.uri")
    assert str(info.value).startswith("spec.model.uri: ")
    assert needle in str(info.value)


def test_join_and_fsspec_url():
    root = parse("s3://ckpt/run1/")
    assert root.join("step-000000010", "COMPLETE") == "s3://ckpt/run1/step-000000010/COMPLETE"
    assert root.fsspec_url == "s3://ckpt/run1"
    with pytest.raises(URIError):
        parse("/local").fsspec_url


def test_every_scheme_is_placed_and_reached():
    """Each entry of the scheme table says how a pod gets it (staged or on disk) and how its bytes
    are read (the Hub, or an fsspec Store that imports); written forms parse back to the scheme."""
    import pkgutil

    from kuberl.api.uri import SCHEMES, in_pod_path
    from kuberl.storage.filesystems import Store

    examples = {"s3": "s3://bucket/p", "gs": "gs://bucket/p", "hf": "hf://org/name", "pvc": "pvc://claim/p",
                "file": "/abs/p"}
    assert set(SCHEMES) == set(examples)
    for name, info in SCHEMES.items():
        parsed = parse(examples[name])
        assert parsed.info is info
        assert info.staged != (info.on_disk is not None), name
        assert info.hub == (info.store is None), name
        if info.store is not None:
            assert isinstance(pkgutil.resolve_name(info.store), Store), name
    assert [in_pod_path(parse(examples[n]), "/stage/x") for n in examples] == [
        "/stage/x", "/stage/x", "/stage/x", "/mnt/pvc/claim/p", "/abs/p"]
    assert parse("org/name").with_revision("v1") == "hf://org/name@v1"


def test_no_scheme_branches_outside_the_table():
    """Scheme behaviour lives in kuberl.api.uri.SCHEMES: code asks the table (``parsed.info.hub``,
    ``.mounted``, ``.on_disk``, ``.store``), never compares a scheme's name."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    branch = re.compile(r"\bscheme\s*(==|!=|in\s*[(\[{]|not\s+in\b)")
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}"
             for folder in ("workloads", "operator") for path in sorted((root / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "branch on the scheme's SchemeInfo in kuberl/api/uri.py instead:\n" + "\n".join(found)


def test_spec_uris_are_typed_once_and_parsed_once_on_use(monkeypatch):
    """The API types hand out SpecURI values: strings to the schema, YAML and JSON, each parsed
    once, naming its field; a bad one still loads (a stored job) and fails only when used."""
    import json
    import pickle

    import yaml

    import kuberl.api.uri as uris
    from kuberl.api.validate import validate_manifest
    from tests.unit.api.bad_manifests import minimal_manifest

    calls = []
    real = uris.parse
    monkeypatch.setattr(uris, "parse", lambda *a: calls.append(a) or real(*a))
    manifest = minimal_manifest()
    manifest["spec"]["checkpoint"] = {"uri": "s3://ckpt/run", "resume": "s3://ckpt/run/step-000000001"}
    spec = validate_manifest(manifest).spec
    uri = spec.model.uri
    assert isinstance(uri, uris.SpecURI) and uri == "s3://models/tiny" and uri.field == "spec.model.uri"
    assert spec.checkpoint.resume.field == "spec.checkpoint.resume"
    assert uri.parsed is uri.parsed and uri.parsed.bucket == "models"
    assert calls.count(("s3://models/tiny", "spec.model.uri")) == 1
    dumped = spec.model_dump(mode="json", by_alias=True)
    assert type(dumped["model"]["uri"]) is str and "s3://models/tiny" in yaml.safe_dump(dumped)
    assert json.loads(json.dumps({"u": uri})) == {"u": "s3://models/tiny"}
    again = pickle.loads(pickle.dumps(spec))  # as Ray sends it to actors: the string and the field
    assert again.model.uri == uri and again.model.uri.field == "spec.model.uri"

    stored = spec.model.model_copy(update={"uri": uris.SpecURI("s3://models/../x", "spec.model.uri")})
    with pytest.raises(URIError, match=r"^spec\.model\.uri: "):
        stored.uri.parsed
