"""The epoch fence of a checkpoint root: once a new trainer group has claimed the root, a rank of
the group it replaced can neither withdraw nor commit a checkpoint there (docs/operations.md,
"A trainer rank is lost"). A local root: the fence is the same code for s3:// and gs://."""

from __future__ import annotations

import pytest

from kuberl.storage import StaleEpoch, StorageError, claim_epoch, commit_records, latest_checkpoint, withdraw_from


def test_a_rank_of_a_replaced_group_cannot_commit_or_withdraw(tmp_path):
    root = str(tmp_path / "ckpt")
    old = claim_epoch(root)
    commit_records(root, 10, [], {"driver.json": b"{}"}, epoch=old)  # the group that still owns the root
    new = claim_epoch(root)
    assert new == old + 1

    with pytest.raises(StaleEpoch, match=rf"committing checkpoint step 20 refused: .*epoch {old}.*epoch {new}"):
        commit_records(root, 20, [], {"driver.json": b"{}"}, epoch=old)
    with pytest.raises(StaleEpoch, match="withdrawing checkpoint step 10 refused"):
        withdraw_from(root, 10, epoch=old)
    assert latest_checkpoint(root).endswith("step-000000010")  # nothing of the old group's changed it
    assert not (tmp_path / "ckpt" / "step-000000020" / "COMPLETE").exists()

    commit_records(root, 20, [], {"driver.json": b"{}"}, epoch=new)
    assert latest_checkpoint(root).endswith("step-000000020")
    assert claim_epoch(root) == new + 1  # a later attempt's group goes on from the stored number


@pytest.mark.parametrize("planted", [b"x" * (1 << 20), b"1e9\n", b"\xff\xfe", b"-3\n"])
def test_an_epoch_file_kuberl_did_not_write_is_refused_naming_it(tmp_path, planted):
    """The root is the bucket owner's: a planted or damaged epoch file ends in an error naming
    the file and the fix, read no further than its head."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "epoch").write_bytes(planted)
    with pytest.raises(StorageError, match=r"ckpt/epoch: not a trainer-group epoch .*Delete it"):
        claim_epoch(str(root))
