"""tests/harness/oci_stream.py: a docker-archive as podman saves it, sent on as OCI layouts that
leave out the layers each node holds (the real containerd imports them in
tests/engine/harness/test_node_store.py and every real-node test)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from tests.harness.oci_stream import IMAGE_NAME, LAYER, ArchiveError, send_oci_layouts

NAME = "ghcr.io/kuberl/worker-cpu:0.1.0"


def _digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _docker_archive(layers: list[bytes], config: bytes, *, manifest: bool = True) -> io.BytesIO:
    """podman save --format=docker-archive's order: layers, config, legacy links, manifest.json."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w|") as tar:
        def add(path: str, data: bytes) -> None:
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for layer in layers:
            add(f"{_digest(layer)[7:]}.tar", layer)
        add(f"{_digest(config)[7:]}.json", config)
        link = tarfile.TarInfo(f"{'ab' * 32}/layer.tar")
        link.type, link.linkname = tarfile.SYMTYPE, f"../{_digest(layers[0])[7:]}.tar"
        tar.addfile(link)
        if manifest:
            add("manifest.json", json.dumps([{"Config": f"{_digest(config)[7:]}.json", "RepoTags": [NAME],
                                              "Layers": [f"{_digest(layer)[7:]}.tar" for layer in layers]}]).encode())
    out.seek(0)
    return out


def _layout(sent: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(sent), mode="r:") as tar:
        return {member.name: tar.extractfile(member).read() for member in tar}


def test_each_node_gets_the_layers_it_lacks_and_a_manifest_listing_all():
    deps, code, config = b"d" * 5000, b"c" * 700, b'{"architecture": "amd64", "os": "linux"}'
    warm, cold = io.BytesIO(), io.BytesIO()
    send_oci_layouts(_docker_archive([deps, code], config), NAME, [warm, cold], [{_digest(deps)}, set()])

    for sent, layers in ((warm, [code]), (cold, [deps, code])):
        files = _layout(sent.getvalue())
        (image,) = json.loads(files["index.json"])["manifests"]
        assert image["annotations"] == {IMAGE_NAME: NAME}
        manifest = files[f"blobs/sha256/{image['digest'][7:]}"]
        assert _digest(manifest) == image["digest"] and len(manifest) == image["size"]
        manifest = json.loads(manifest)
        assert manifest["config"]["digest"] == _digest(config) and files[f"blobs/sha256/{_digest(config)[7:]}"] == config
        # Every layer, in order, by the digest and size of its bytes: containerd unpacks by them.
        assert [(entry["digest"], entry["size"], entry["mediaType"]) for entry in manifest["layers"]] == [
            (_digest(deps), len(deps), LAYER), (_digest(code), len(code), LAYER)]
        assert {path for path in files if path.startswith("blobs/")} == {
            f"blobs/sha256/{_digest(blob)[7:]}" for blob in (*layers, config, files[f"blobs/sha256/{image['digest'][7:]}"])}
        assert all(files[f"blobs/sha256/{_digest(layer)[7:]}"] == layer for layer in layers)
        assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}


def test_an_archive_without_its_manifest_is_refused():
    with pytest.raises(ArchiveError, match="no manifest.json in the archive of " + NAME):
        send_oci_layouts(_docker_archive([b"x"], b"{}", manifest=False), NAME, [io.BytesIO()], [set()])
