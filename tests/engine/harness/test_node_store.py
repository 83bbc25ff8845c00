"""The real nodes' containerd roots kept between sessions (tests/harness/nodes.py NodeStores): one
session at a time holds them, what they say is imported is only what is still there, and the last
session's containers go before a node starts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import pytest

from tests.harness import images, oci_stream
from tests.harness.nodes import NodeStores, RealNode, host_tools_missing


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



@contextlib.contextmanager
def _containerd(node: RealNode):
    """Debian's containerd on the node's root, without CRI, while the block runs."""
    config = node.write_containerd_config(images.PAUSE_IMAGE, cri=False)
    daemon = subprocess.Popen(["containerd", f"--config={config}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([*node.ctr(), "version"], capture_output=True).returncode != 0:
            assert daemon.poll() is None and time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.2)
        yield [*node.ctr(), "-n", "k8s.io"]
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


def test_scrub_removes_the_last_sessions_containers_and_keeps_the_images(tmp_path):
    """With the real containerd: a kept root holding a container of a session that is gone comes
    back with its image and without the container."""
    if os.geteuid() != 0 or host_tools_missing():
        pytest.skip("needs root and containerd (`bash .ci/setup --tests`)")
    images.build(())  # the pause image (tiny, built once)
    stores = NodeStores.claim(tmp_path)
    node = RealNode("real-node-0", 0, "10.240.0.10", tmp_path / "session", containerd_root=stores.root("real-node-0"))
    node.directory.mkdir()
    with _containerd(node) as ctr:
        images.import_into([node.ctr()], images.PAUSE_IMAGE, images.PAUSE_IMAGE, [tmp_path / "import.log"])
        subprocess.run([*ctr, "containers", "create", images.PAUSE_IMAGE, "pod-of-a-gone-cluster"], check=True)

    stores.scrub(node, images.PAUSE_IMAGE, tmp_path / "scrub.log")

    with _containerd(node) as ctr:
        containers = subprocess.run([*ctr, "containers", "ls", "-q"], check=True, capture_output=True, text=True).stdout
        kept = subprocess.run([*ctr, "images", "ls", "-q"], check=True, capture_output=True, text=True).stdout
    assert containers.split() == [], (tmp_path / "scrub.log").read_text()[-2000:]
    assert images.PAUSE_IMAGE in kept.split()
    stores.release()


def test_an_import_needs_room_only_for_the_layers_a_node_lacks():
    """A code change rebuilds worker-cpu's small top layer; its 6.7 GB dependency layer is
    already in the kept nodes and costs no disk."""
    layers = {"sha256:deps": 6_683_292_672, "sha256:kuberl": 63_238_144}
    assert images.import_need(layers, [{"sha256:deps"}, {"sha256:deps"}]) == 2 * 2 * 63_238_144
    assert images.import_need(layers, [set()]) == 2 * (6_683_292_672 + 63_238_144)
    assert images.import_need(layers, [set(layers)]) == 0


def test_layer_sizes_of_a_built_image_come_from_podmans_layer_index():
    if os.geteuid() != 0 or host_tools_missing():
        pytest.skip("needs root and podman (`bash .ci/setup --tests`)")
    images.build(())
    sizes = images.layer_sizes(images.PAUSE_IMAGE)
    assert sizes and all(digest.startswith("sha256:") and size > 0 for digest, size in sizes.items())


def test_an_import_replaces_the_nodes_superseded_kuberl_image_and_brings_the_pause_image_back(tmp_path, monkeypatch):
    """With the real containerd and the tiny pause image under kuberl names: a new base tag
    replaces the old one (removed after the import: it fits beside it), and the pause image, gone
    from the node, comes back. When the import would not fit beside the superseded image (a full
    disk cannot be made here: `room_for_import` answers no), that image is gone before the import."""
    if os.geteuid() != 0 or host_tools_missing():
        pytest.skip("needs root, containerd and podman (`bash .ci/setup --tests`)")
    from tests.harness.harness import Cluster

    images.build(())  # the pause image (tiny, built once)
    cluster = Cluster(tmp_path / "cluster", nodes=0, real_nodes=1)
    cluster.log_dir.mkdir(parents=True)
    (node,) = cluster.real_nodes
    node.directory = tmp_path / "node"  # containerd's socket paths must stay under 108 characters
    node.directory.mkdir()
    old, new = "localhost/kuberl/probe:0ld", "localhost/kuberl/probe:n3w"
    with contextlib.ExitStack() as cleanup, _containerd(node) as ctr:
        # import_into names the image in podman's store as it imports it: those names go again.
        cleanup.callback(subprocess.run, images.podman_argv("untag", images.PAUSE_IMAGE, old, new), capture_output=True)

        def held() -> set[str]:
            return set(subprocess.run([*ctr, "images", "ls", "-q"], check=True, capture_output=True, text=True).stdout.split())

        cluster._import([node], images.PAUSE_IMAGE, old)
        subprocess.run([*ctr, "images", "rm", "--sync", images.PAUSE_IMAGE], capture_output=True)
        assert held() == {old}

        cluster._import([node], images.PAUSE_IMAGE, new)
        assert held() == {new, images.PAUSE_IMAGE}
        assert cluster._imported[node.name] == {new: images.PAUSE_IMAGE, images.PAUSE_IMAGE: images.PAUSE_IMAGE}

        seen_at_import = []
        real_import = images.import_into
        monkeypatch.setattr(images, "room_for_import", lambda *args: False)
        monkeypatch.setattr(images, "import_into", lambda *args: (seen_at_import.append(held()), real_import(*args)))
        cluster._imported[node.name][new] = "an earlier build"  # the same name from another source
        cluster._import([node], images.PAUSE_IMAGE, new)
        assert seen_at_import == [{images.PAUSE_IMAGE}]  # the superseded image went first
        assert held() == {new, images.PAUSE_IMAGE}


def test_a_reimport_holds_the_image_it_replaces_until_the_new_one_is_unpacked(tmp_path):
    """With the real containerd: while `ctr images import` moves a name to its new image and
    unpacks it, the image the name had stays held under a second name, so that no garbage
    collection in between deletes the layers both share (containerd/containerd#3787: "parent
    snapshot ... does not exist"). The second name goes when the import is done."""
    if os.geteuid() != 0 or host_tools_missing():
        pytest.skip("needs root, containerd and podman (`bash .ci/setup --tests`)")
    images.build(())  # the pause image (tiny, built once)
    node = RealNode("real-node-0", 0, "10.240.0.10", tmp_path / "node")
    node.directory.mkdir()
    seen = tmp_path / "held-as-the-import-starts"
    watched = tmp_path / "ctr"  # ctr, writing down the node's images as each import starts
    watched.write_text(f'#!/bin/sh\ncase "$*" in *"images import"*) {" ".join(node.ctr())} -n k8s.io images ls -q '
                       f'>> {seen}; echo -- >> {seen};; esac\nexec {" ".join(node.ctr())} "$@"\n')
    watched.chmod(0o755)
    held = images.PAUSE_IMAGE + images.HELD_DURING_IMPORT
    with _containerd(node) as ctr:
        images.import_into([[str(watched)]], images.PAUSE_IMAGE, images.PAUSE_IMAGE, [tmp_path / "import.log"])
        images.import_into([[str(watched)]], images.PAUSE_IMAGE, images.PAUSE_IMAGE, [tmp_path / "import.log"])
        after = subprocess.run([*ctr, "images", "ls", "-q"], check=True, capture_output=True, text=True).stdout.split()
    first, second = [block.split() for block in seen.read_text().split("--")[:2]]
    assert first == []  # a new name: nothing to hold
    assert sorted(second) == sorted([images.PAUSE_IMAGE, held]), (tmp_path / "import.log").read_text()
    assert after == [images.PAUSE_IMAGE]


def test_an_import_whose_stream_fails_lets_go_of_the_held_name(tmp_path, monkeypatch):
    """An error in the stream itself (not an import's: a bad archive) still ends every import and
    removes the held second name: the node keeps the image the name had, and nothing else."""
    if os.geteuid() != 0 or host_tools_missing():
        pytest.skip("needs root, containerd and podman (`bash .ci/setup --tests`)")
    images.build(())
    node = RealNode("real-node-0", 0, "10.240.0.10", tmp_path / "node")
    node.directory.mkdir()

    def bad_archive(*args):
        raise oci_stream.ArchiveError("not a docker archive")

    with _containerd(node) as ctr:
        images.import_into([node.ctr()], images.PAUSE_IMAGE, images.PAUSE_IMAGE, [tmp_path / "import.log"])
        monkeypatch.setattr(oci_stream, "send_oci_layouts", bad_archive)
        with pytest.raises(oci_stream.ArchiveError):
            images.import_into([node.ctr()], images.PAUSE_IMAGE, images.PAUSE_IMAGE, [tmp_path / "import.log"])
        after = subprocess.run([*ctr, "images", "ls", "-q"], check=True, capture_output=True, text=True).stdout.split()
    assert after == [images.PAUSE_IMAGE], (tmp_path / "import.log").read_text()
