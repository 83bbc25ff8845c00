"""Parsing of the storage URIs a job names (model, data, checkpoints).

Pure and dependency-free: the API types, the renderer, the stager and the workers all use it,
so a URI means the same thing everywhere.

Accepted forms:
- ``s3://bucket/prefix``, ``gs://bucket/prefix`` (cloud object stores, through fsspec)
- ``hf://org/name`` or ``hf://org/name@revision`` and bare Hugging Face ids such as
  ``Qwen/Qwen2.5-1.5B-Instruct`` (neither local nor cloud: fetched with huggingface_hub)
- ``pvc://claim/path`` (a PersistentVolumeClaim mounted into the pod)
- absolute local paths (already in the image or on a mounted volume)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Literal

from kuberl.api.contract import PVC_ROOT

Scheme = Literal["s3", "gs", "hf", "pvc", "file"]

# A Hugging Face repo id: "name" or "org/name"; letters, digits, '-', '_', '.'.
_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
# S3 and GCS bucket names: lowercase letters, digits, '-', '.', '_' (GCS), 3-63 chars.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
# A Kubernetes object name (DNS-1123 subdomain) for PVC claims.
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

# The same rules as OpenAPI patterns (RE2, no look-around), so that the API server rejects
# unknown schemes and bad bucket or claim names before the operator sees the job.
_BUCKET_RE = r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]"
_HF_RE = r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?"
_CLAIM_RE = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


@dataclass(frozen=True)
class SchemeInfo:
    """Everything kuberl decides per storage scheme; a new scheme is one entry in SCHEMES, and no
    code outside this table asks for a scheme by name (tests/unit/test_uri.py keeps it so)."""

    name: Scheme
    # The CRD pattern of this scheme's URIs after "<scheme>://" (None: absolute paths, "/...").
    tail: str | None
    # Parses what follows "<scheme>://" (field, uri, rest); None: never written with "://".
    split: Callable[[str, str, str], ParsedURI] | None
    # Copied into the pod by a ``kuberl stage`` init container (else read in place).
    staged: bool
    # May hold checkpoints (written by the trainers).
    checkpoints: bool
    # An object store reached through fsspec with credentials from a Secret.
    cloud: bool
    # Its path on a pod's (or this machine's) disk, given where claims are mounted; None: not on
    # disk, it is fetched (staged) first.
    on_disk: Callable[[ParsedURI, str], str] | None = None
    # A PersistentVolumeClaim the pod mounts at <pvc root>/<claim> (the URI's bucket).
    mounted: bool = False
    # A Hugging Face Hub repo: versioned by a revision, fetched with huggingface_hub, not fsspec.
    hub: bool = False
    # "module:attribute" of its fsspec access (kuberl.storage.filesystems.Store), imported on first
    # use so that this module needs no fsspec; None for the Hub.
    store: str | None = None


def _split_bucket(field: str, uri: str, rest: str) -> ParsedURI:
    scheme = uri.split("://", 1)[0]
    bucket, _, path = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise URIError(f"{field}: {uri!r} has no valid bucket name after {scheme}:// "
                       f"(lowercase letters, digits, '-', '.', 3-63 characters)")
    _reject_dot_segments(uri, path, field)
    return ParsedURI(scheme, bucket, path.strip("/"), None, uri)  # type: ignore[arg-type]


def _split_hf(field: str, uri: str, rest: str) -> ParsedURI:
    repo, _, revision = rest.partition("@")
    if not _HF_ID.match(repo):
        raise URIError(f"{field}: {uri!r} is not hf://org/name[@revision]")
    _check_revision(uri, revision, field)
    return ParsedURI("hf", repo, "", revision or None, uri)


def _split_claim(field: str, uri: str, rest: str) -> ParsedURI:
    claim, _, path = rest.partition("/")
    if not _DNS1123.match(claim):
        raise URIError(f"{field}: {uri!r}: the claim name {claim!r} is not a valid "
                       f"Kubernetes name (pvc://claim-name/path)")
    _reject_dot_segments(uri, path, field)
    return ParsedURI("pvc", claim, path.strip("/"), None, uri)


def _claim_path(parsed: ParsedURI, pvc_root: str) -> str:
    return f"{pvc_root}/{parsed.bucket}/{parsed.path}".rstrip("/")


def _absolute_path(parsed: ParsedURI, pvc_root: str) -> str:
    return parsed.path


_STORES = "kuberl.storage.filesystems"
SCHEMES: dict[str, SchemeInfo] = {
    "s3": SchemeInfo("s3", rf"{_BUCKET_RE}(/\S*)?", _split_bucket, staged=True, checkpoints=True, cloud=True,
                     store=f"{_STORES}:S3"),
    "gs": SchemeInfo("gs", rf"{_BUCKET_RE}(/\S*)?", _split_bucket, staged=True, checkpoints=True, cloud=True,
                     store=f"{_STORES}:GCS"),
    "hf": SchemeInfo("hf", rf"{_HF_RE}(@\S+)?", _split_hf, staged=True, checkpoints=False, cloud=False,
                     hub=True),
    "pvc": SchemeInfo("pvc", rf"{_CLAIM_RE}(/\S*)?", _split_claim, staged=False, checkpoints=True, cloud=False,
                      on_disk=_claim_path, mounted=True, store=f"{_STORES}:LOCAL"),
    "file": SchemeInfo("file", None, None, staged=False, checkpoints=True, cloud=False,
                       on_disk=_absolute_path, store=f"{_STORES}:LOCAL"),
}
# Bare Hugging Face ids ("org/name[@revision]") parse as "hf".
_BARE_HF_PATTERN = rf"{_HF_RE}(@\S+)?"


def _pattern(schemes: list[SchemeInfo], *extra: str) -> str:
    """One anchored alternation; schemes with the same tail share one alternative ("(s3|gs)://")."""
    by_tail: dict[str | None, list[str]] = {}
    for info in schemes:
        by_tail.setdefault(info.tail, []).append(info.name)
    alternatives = []
    for tail, names in by_tail.items():
        if tail is None:
            alternatives.append(r"/\S*")
        else:
            prefix = names[0] if len(names) == 1 else "(" + "|".join(names) + ")"
            alternatives.append(f"{prefix}://{tail}")
    return "^(" + "|".join([*alternatives, *extra]) + ")$"


URI_PATTERN = _pattern(list(SCHEMES.values()), _BARE_HF_PATTERN)
# Where checkpoints may be written: object stores, a PVC or a mounted path (not the Hub).
CHECKPOINT_URI_PATTERN = _pattern([info for info in SCHEMES.values() if info.checkpoints])
# Where the job's own code may come from (spec.reward.source.uri): one file, so not a Hub repo.
CODE_URI_PATTERN = _pattern([info for info in SCHEMES.values() if not info.hub])


# A Hugging Face revision (branch, tag, "refs/pr/<n>" or a 40-hex commit id) goes into request
# paths and huggingface_hub's cache paths: accept only what `git check-ref-format --allow-onelevel`
# accepts. Each rule is a regular expression (RE2 and Python alike) that matches a revision
# breaking it; the CRD's CEL rules and parse() use this one table. Rules written with '^' are
# anchored at the revision's start (see REVISION_IN_URI_PATTERN).
REVISION_RULES: tuple[tuple[str, str], ...] = (
    (r"[\x00-\x20\x7f~^:?*\[\\]", "spaces, control characters and ~ ^ : ? * [ \\"),
    (r"[.][.]", "'..'"),
    (r"@[{]", "'@{'"),
    (r"^@$", "'@' alone"),
    (r"^/", "a leading '/'"),
    (r"/$", "a trailing '/'"),
    (r"//", "'//'"),
    (r"^[.]", "a component starting with '.'"),
    (r"/[.]", "a component starting with '.'"),
    (r"[.]lock$", "a component ending in '.lock'"),
    (r"[.]lock/", "a component ending in '.lock'"),
    (r"[.]$", "a trailing '.'"),
)
MAX_REVISION_LENGTH = 255
# Matches a path with a '.' or '..' segment (parse() refuses those for every scheme).
DOT_SEGMENT_VIOLATION = r"(^|/)[.][.]?(/|$)"
# Matches a bad revision.
REVISION_VIOLATION = "|".join(f"({rule})" for rule, _ in REVISION_RULES)
# Matches a Hugging Face URI (hf://org/name@rev or org/name@rev) whose revision is bad.
REVISION_IN_URI_VIOLATION = rf"^(hf://)?{_HF_RE}@(" + "|".join(
    f"({rule[1:]})" if rule.startswith("^") else f"(.*{rule})" for rule, _ in REVISION_RULES) + ")"
REVISION_RULES_TEXT = ("a branch, tag or commit as git allows them: no " +
                       ", ".join(dict.fromkeys(why for _, why in REVISION_RULES)) +
                       f"; at most {MAX_REVISION_LENGTH} characters")


def revision_problem(revision: str) -> str | None:
    """Why ``revision`` is not a revision git would accept, or None."""
    if not revision or len(revision) > MAX_REVISION_LENGTH:
        return f"must be 1-{MAX_REVISION_LENGTH} characters"
    for rule, why in REVISION_RULES:
        if re.search(rule, revision):
            return f"contains {why} (git refuses such names)"
    return None


class URIError(ValueError):
    """A URI a user wrote is malformed; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class ParsedURI:
    scheme: Scheme
    # s3/gs: bucket; hf: repo id ("org/name"); pvc: claim name; file: "".
    bucket: str
    # s3/gs/pvc: the key prefix / path inside the bucket or claim, without leading '/';
    # file: the absolute path; hf: subfolder ("" for the whole repo).
    path: str
    revision: str | None = None
    original: str = ""

    @property
    def info(self) -> SchemeInfo:
        return SCHEMES[self.scheme]

    @property
    def is_cloud(self) -> bool:
        return self.info.cloud

    @property
    def fsspec_url(self) -> str:
        """The URL fsspec understands for cloud schemes."""
        if not self.is_cloud:
            raise URIError(f"{self.original!r} is not a cloud object-store URI")
        return f"{self.scheme}://{self.bucket}/{self.path}".rstrip("/")

    def on_disk(self, pvc_root: str) -> str | None:
        """Its path on disk, claims mounted at ``pvc_root``; None where it must be fetched first."""
        return self.info.on_disk(self, pvc_root) if self.info.on_disk else None

    def with_revision(self, revision: str) -> str:
        """The URI of this Hub repo at ``revision`` (``hf://org/name@revision``)."""
        return f"{self.scheme}://{self.bucket}@{revision}"

    def join(self, *parts: str) -> str:
        """A child URI, e.g. ``parse("s3://b/ckpt").join("step-1")`` -> ``"s3://b/ckpt/step-1"``."""
        tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
        base = self.original.rstrip("/")
        return f"{base}/{tail}" if tail else base


def parse(uri: str, field: str = "uri") -> ParsedURI:
    """Parse ``uri``; raise URIError naming ``field`` and the accepted forms when it is bad."""
    if not isinstance(uri, str) or not uri.strip():
        raise URIError(f"{field}: must be a non-empty URI ({_FORMS})")
    if uri != uri.strip() or any(c.isspace() for c in uri):
        raise URIError(f"{field}: {uri!r} contains whitespace")
    if "://" in uri:
        scheme, rest = uri.split("://", 1)
        info = SCHEMES.get(scheme)
        if info is not None and info.split is not None:
            return info.split(field, uri, rest)
        raise URIError(f"{field}: unknown scheme {scheme + '://'!r} in {uri!r} ({_FORMS})")
    if uri.startswith("/"):
        _reject_dot_segments(uri, uri, field)
        return ParsedURI("file", "", uri, None, uri)
    repo, _, revision = uri.partition("@")
    if _HF_ID.match(repo) and not repo.startswith("."):
        _check_revision(uri, revision, field)
        return ParsedURI("hf", repo, "", revision or None, uri)
    raise URIError(f"{field}: {uri!r} is neither an absolute path nor a known URI ({_FORMS})")


class SpecURI(str):
    """A URI as the job's spec holds it: the string itself (what the spec, the CRD, YAML and JSON
    see) and the field that holds it, parsed once, when first asked (``parsed``). The API types
    give their URI fields this type (``kuberl.api.types.uri_type``), so the renderer and the run
    plan parse each URI once. Parsing waits for first use so that a stored job with a bad URI
    still loads, and is refused by ``kuberl.api.validate.uri_errors`` with the field named."""

    field: str

    def __new__(cls, value: str, field: str = "uri") -> SpecURI:
        uri = super().__new__(cls, value)
        uri.field = field
        return uri

    @cached_property
    def parsed(self) -> ParsedURI:
        """``parse(self, self.field)``: URIError naming the field when the URI is bad."""
        return parse(str(self), self.field)

    def __reduce__(self) -> tuple:
        # Pickled (to Ray actors) as the string and field only; the parse is redone there on use.
        return (SpecURI, (str(self), self.field))


def _check_revision(uri: str, revision: str, field: str) -> None:
    problem = revision_problem(revision) if revision or uri.endswith("@") else None
    if problem:
        raise URIError(f"{field}: the revision {revision!r} in {uri!r} {problem}; give {REVISION_RULES_TEXT}")


def in_pod_path(parsed: ParsedURI, staged_dir: str) -> str:
    """The path a container reads ``parsed`` from: the staged copy, a mounted claim, or itself."""
    if parsed.info.staged:
        return staged_dir
    on_disk = parsed.on_disk(PVC_ROOT)
    assert on_disk is not None, "every scheme is staged or on disk (tests/unit/test_uri.py checks the table)"
    return on_disk


def _reject_dot_segments(uri: str, path: str, field: str) -> None:
    if any(seg in (".", "..") for seg in path.split("/")):
        raise URIError(f"{field}: {uri!r} contains '.' or '..' path segments; write the path plainly")


_FORMS = ("s3://bucket/prefix, gs://bucket/prefix, hf://org/name[@revision], a Hugging Face id "
          "like Qwen/Qwen2.5-1.5B-Instruct, pvc://claim/path, or an absolute path")
