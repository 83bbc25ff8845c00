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

    root = Path(__file__).resolve().parents[1]
    branch = re.compile(r"\bscheme\s*(==|!=|in\s*[(\[{]|not\s+in\b)")
    found = [f"{path.relative_to(root)}:{n}: {line.strip()}"
             for folder in ("workloads", "operator") for path in sorted((root / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "branch on the scheme's SchemeInfo in kuberl/api/uri.py instead:\n" + "\n".join(found)
