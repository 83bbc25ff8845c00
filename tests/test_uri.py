import pytest

from kuberl.uri import URIError, parse


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
