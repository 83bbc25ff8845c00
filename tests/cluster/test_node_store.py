"""The real nodes' containerd roots kept between sessions (tests/cluster/nodes.py NodeStores): one
session at a time holds them, and what they say is imported is only what is still there."""

from __future__ import annotations

from tests.cluster.nodes import NodeStores


def test_one_session_at_a_time_holds_the_stores(tmp_path):
    first = NodeStores.claim(tmp_path)
    assert first is not None and first.root("real-node-0") == tmp_path / "node-store" / "real-node-0" / "containerd-root"
    # A concurrent session imports into throwaway roots rather than a second copy on disk.
    assert NodeStores.claim(tmp_path) is None
    first.release()
    second = NodeStores.claim(tmp_path)
    assert second is not None
    second.release()


def test_the_record_keeps_only_images_still_in_containerd(tmp_path):
    stores = NodeStores.claim(tmp_path)
    (stores.directory / "real-node-0").mkdir()
    assert stores.imported("real-node-0", {"ghcr.io/kuberl/worker-cpu:0.1.0"}) == {}
    stores.remember("real-node-0", {"ghcr.io/kuberl/worker-cpu:0.1.0": "localhost/kuberl/worker-cpu:abc",
                                     "ghcr.io/kuberl/operator:0.1.0": "localhost/kuberl/operator:def"})
    # kubelet's image GC removed the operator image in the last session: it is imported again.
    assert stores.imported("real-node-0", {"ghcr.io/kuberl/worker-cpu:0.1.0", "other"}) == {
        "ghcr.io/kuberl/worker-cpu:0.1.0": "localhost/kuberl/worker-cpu:abc"}
    stores.release()
