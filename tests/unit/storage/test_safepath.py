import pytest

from kuberl.storage import StorageError
from kuberl.storage.errors import is_transient
from kuberl.storage.safepath import checked_relpath


@pytest.mark.parametrize("key", ["a.txt", "dir/sub/b.safetensors", "..hidden/x", "a..b"])
def test_plain_keys_pass(key):
    assert checked_relpath(key, "s3://b/p") == key


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a\\..\\b",
                                 "nul\x00byte", ".complete", ".kuberl-stage.journal",
                                 "d/.f.kuberl-part"])
def test_escaping_or_reserved_keys_are_refused(key):
    with pytest.raises(StorageError, match="s3://b/p: refusing object key"):
        checked_relpath(key, "s3://b/p")


def test_transient_classification():
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError("x"))
    assert not is_transient(PermissionError("x"))
    assert not is_transient(ValueError("x"))
