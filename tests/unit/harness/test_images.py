"""What the harness removes from a real node before or after importing an image, and when an import
fits on the disk (tests/harness/images.py's pure parts; the imports run in tests/e2e)."""

from tests.harness.images import PAUSE_IMAGE, import_fits, repository, superseded

GiB = 2**30
# The shared 2-core machine's disk, and a worker-cpu import into two nodes: each node keeps a
# layer twice (blob and snapshot).
DISK = 252 * GiB
NEW_DEPENDENCIES = 2 * 2 * 6_683_292_672
NEW_CODE = 2 * 2 * 63_238_144


def test_an_import_supersedes_only_earlier_images_of_its_own_kuberl_repository():
    held = ["ghcr.io/kuberl/worker-cpu:0.1.0", "ghcr.io/kuberl/operator:0.1.0", PAUSE_IMAGE,
            "localhost/kuberl/base-bookworm:0ld0ld0ld0ld", "ghcr.io/kuberl/worker-cpu-gpu:0.1.0"]
    # The earlier build under the same public name: its layers are what fills the disk.
    assert superseded(held, "ghcr.io/kuberl/worker-cpu:0.1.0") == ["ghcr.io/kuberl/worker-cpu:0.1.0"]
    # An earlier base under its older hash tag (a name the new import would not take over).
    assert superseded(held, "localhost/kuberl/base-bookworm:n3wn3wn3wn3w") == ["localhost/kuberl/base-bookworm:0ld0ld0ld0ld"]
    assert superseded(held, "ghcr.io/kuberl/stager:0.1.0") == []
    # Nothing outside kuberl's repositories, whatever is imported: the pause image cannot be pulled back.
    assert superseded(held, PAUSE_IMAGE) == []
    assert superseded(["registry.k8s.io/pause:3.9", PAUSE_IMAGE], "registry.k8s.io/pause:3.10.2") == []
    assert repository("localhost:5000/kuberl/x:1") == "localhost:5000/kuberl/x"
    assert repository("ghcr.io/kuberl/worker-cpu") == "ghcr.io/kuberl/worker-cpu"


def test_an_import_fits_only_with_a_reserve_well_above_the_kubelets_eviction_threshold():
    # A code change adds worker-cpu's small code layer: it fits beside the old image.
    assert import_fits(NEW_CODE, 27 * GiB, DISK)
    # New dependencies (a lock change) beside the old 2 x 13 GiB do not fit in 27 GiB ...
    assert not import_fits(NEW_DEPENDENCIES, 27 * GiB, DISK)
    # ... but do once the superseded image is gone.
    assert import_fits(NEW_DEPENDENCIES, 27 * GiB + NEW_DEPENDENCIES, DISK)
    # Last session's near-miss: the old check (free >= 1.1 x need) let this through, leaving about
    # 1 % of the disk, the kubelets' eviction threshold, under which they delete every unused image.
    assert not import_fits(NEW_DEPENDENCIES, int(NEW_DEPENDENCIES * 1.1), DISK)
