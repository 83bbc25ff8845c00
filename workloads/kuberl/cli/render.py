"""`kuberl render -f job.yaml`: print what the operator would create for a manifest."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from kuberl.api.uri import URIError
from kuberl.api.validate import ManifestError
from kuberl.job.plan import YAML_DUMPER, YAML_LOADER
from kuberl.job.render import render_manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kuberl render", description=__doc__)
    parser.add_argument("-f", "--filename", required=True, help="RLTrainingJob manifest (YAML), or - for stdin")
    parser.add_argument("-n", "--namespace", help="namespace, when the manifest has none")
    parser.add_argument("--attempt", type=int, default=0, help="restart number (0 for the first run; "
                        "restarts resume from the newest checkpoint under spec.checkpoint.uri)")
    args = parser.parse_args(argv)
    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
    except OSError as exc:
        print(f"kuberl render: cannot read {args.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        docs = [d for d in yaml.load_all(text, Loader=YAML_LOADER) if d is not None]
    except yaml.YAMLError as exc:
        print(f"kuberl render: {args.filename} is not valid YAML: {exc}", file=sys.stderr)
        return 1
    out = []
    for doc in docs:
        if isinstance(doc, dict) and args.namespace:
            doc.setdefault("metadata", {}).setdefault("namespace", args.namespace)
        try:
            out += render_manifest(doc, attempt=args.attempt)
        except (ManifestError, URIError) as exc:
            print(f"kuberl render: {args.filename}: {exc}", file=sys.stderr)
            return 1
    sys.stdout.write(yaml.dump_all(out, Dumper=YAML_DUMPER, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
