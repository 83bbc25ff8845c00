"""`podman save`'s docker-archive, streamed on as one OCI image layout per containerd, each
carrying only the layers that containerd lacks.

A code change rebuilds worker-cpu's small code layer; its 6.7 GB dependency layer is already in
the nodes. `ctr images import` of the whole docker-archive writes every layer into the content
store again before it finds it there (a docker-archive names layers by file, so containerd must
hash each to know it), twice for two nodes: minutes of disk writes for nothing. containerd's
docker-archive importer refuses an archive without every layer; its OCI layout importer takes
the blobs the tar holds and reads only the manifest and config, and unpacking needs a layer's
blob only where its snapshot is missing. So each node gets an OCI layout whose manifest lists
every layer and whose tar holds the manifest, the config and the layers not in `present`.

The layer files of podman's docker-archive are named by the digest of their bytes (uncompressed),
the digest under which containerd keeps them: `<hex>.tar`, the config `<hex>.json`, then
`manifest.json`. containerd hashes every blob it takes and looks the manifest's up by digest,
so a wrong name fails the import rather than importing something else.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from typing import BinaryIO

LAYER = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# The annotation `ctr images import` names an image by.
IMAGE_NAME = "io.containerd.image.name"
_DIGEST_FILE = re.compile(r"(?P<hex>[0-9a-f]{64})\.(?P<kind>tar|json)")
_BLOCK = 512
CHUNK = 1 << 20


class ArchiveError(ValueError):
    """The archive is not the docker-archive podman writes."""


def send_oci_layouts(archive: BinaryIO, name: str, outs: list[BinaryIO], present: list[set[str]]) -> None:
    """Read the docker-archive `archive` once and write to each of `outs` an OCI layout tar
    naming the image `name`, without the layers whose digests its `present` set holds."""
    sizes: dict[str, int] = {}
    config: tuple[str, bytes] | None = None
    manifest = None
    with tarfile.open(fileobj=archive, mode="r|") as tar:
        for member in tar:
            match = _DIGEST_FILE.fullmatch(member.name) if member.isfile() else None
            if match and match["kind"] == "tar":
                digest = f"sha256:{match['hex']}"
                sizes[digest] = member.size
                lacking = [out for out, digests in zip(outs, present) if digest not in digests]
                _write_member(lacking, _blob_path(digest), member.size, tar.extractfile(member))
            elif match:
                config = (f"sha256:{match['hex']}", tar.extractfile(member).read())
            elif member.name == "manifest.json":
                manifest = json.loads(tar.extractfile(member).read())
    if config is None or not manifest:
        raise ArchiveError(f"no {'config' if config is None else 'manifest.json'} in the archive of {name}")
    layers = [f"sha256:{_DIGEST_FILE.fullmatch(f)['hex']}" for f in manifest[0]["Layers"]]
    blobs = {config[0]: config[1]}
    image = json.dumps({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": {"mediaType": CONFIG, "digest": config[0], "size": len(config[1])},
        "layers": [{"mediaType": LAYER, "digest": digest, "size": sizes[digest]} for digest in layers],
    }).encode()
    image_digest = f"sha256:{hashlib.sha256(image).hexdigest()}"
    blobs[image_digest] = image
    index = json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": MANIFEST, "digest": image_digest, "size": len(image), "annotations": {IMAGE_NAME: name}}]}).encode()
    files = {_blob_path(digest): data for digest, data in blobs.items()}
    files |= {"index.json": index, "oci-layout": b'{"imageLayoutVersion": "1.0.0"}'}
    for path, data in files.items():
        _write_member(outs, path, len(data), io.BytesIO(data))
    for out in outs:
        out.write(b"\0" * 2 * _BLOCK)  # the end of a tar


def _blob_path(digest: str) -> str:
    return "blobs/" + digest.replace(":", "/")


def _write_member(outs: list[BinaryIO], path: str, size: int, data: BinaryIO) -> None:
    """A regular file of `size` bytes read from `data`, into each tar of `outs`."""
    header = tarfile.TarInfo(path)
    header.size, header.mode = size, 0o444
    block = header.tobuf(tarfile.GNU_FORMAT)
    for out in outs:
        out.write(block)
    if outs:
        while chunk := data.read(CHUNK):
            for out in outs:
                out.write(chunk)
    for out in outs:
        out.write(b"\0" * (-size % _BLOCK))
