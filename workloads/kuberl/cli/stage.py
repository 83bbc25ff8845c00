"""``kuberl stage SRC DST``: what each worker pod's init container runs before Ray starts.

Exit status 0 when DST holds a verified copy of SRC (``DST/.complete`` lists it), 1 on a
permanent error (the message names the URI and the fix), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kuberl.api.uri import URIError
from kuberl.storage.checkpoints import checkpoint_to_restore
from kuberl.storage.code import stage_code
from kuberl.storage.errors import StorageError
from kuberl.storage.staging import DEFAULT_PART_SIZE, DEFAULT_WORKERS, stage


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kuberl stage",
        description="Copy a model or checkpoint from s3://, gs://, hf://, a Hugging Face id, "
                    "pvc:// or an absolute path into DST, verified and resumable. Credentials "
                    "come from the environment only (AWS_*, AWS_ENDPOINT_URL[_S3], "
                    "GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST, HF_TOKEN).")
    parser.add_argument("src", help="source URI")
    parser.add_argument("dst", help="destination directory (created if missing)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help=f"concurrent requests (default {DEFAULT_WORKERS})")
    parser.add_argument("--part-size", type=_size, default=DEFAULT_PART_SIZE,
                        help="bytes per ranged request for large files (default 8MiB); each "
                             "range streams in 1 MiB blocks, so memory stays near workers x 1MiB")
    parser.add_argument("--checksum", choices=("auto", "size"), default="auto",
                        help="auto: verify sizes and the fastest checksum the store gives "
                             "(CRC32C, CRC32, else the ETag's MD5); size: sizes only (for "
                             "SSE-KMS/SSE-C objects, whose ETags are not MD5s)")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="skip files whose relative path matches GLOB (repeatable)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="SRC is a checkpoint root or one step-<n> checkpoint: stage the newest "
                             "complete checkpoint under the root (nothing, and exit 0, when there is "
                             "none yet), or the named one if complete")
    parser.add_argument("--sha256", metavar="HEX",
                        help="SRC is the job's own code (one .py or .tar file): refuse it unless its "
                             "sha256 is HEX, and make DST the directory of its code")
    parser.add_argument("--field", default="source",
                        help="the spec field --sha256's source comes from, for errors (e.g. spec.reward.source)")
    parser.add_argument("--no-unpack", action="store_true",
                        help="keep a .tar source as a file instead of unpacking it")
    parser.add_argument("--log-interval", type=float, default=10.0, metavar="SECONDS",
                        help="seconds between progress log lines when not on a terminal")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    if args.workers < 1 or args.part_size < 1:
        print("kuberl stage: --workers and --part-size must be positive", file=sys.stderr)
        return 2
    try:
        if args.sha256:
            stage_code(args.src, args.dst, args.sha256, field=args.field)
            print(f"kuberl stage: {args.field}: {args.src} (sha256 {args.sha256}) -> {args.dst}")
            return 0
        src = args.src
        if args.checkpoint:
            src = checkpoint_to_restore(args.src)
            if src is None:
                print(f"kuberl stage: {args.src} holds no complete checkpoint yet; nothing to stage")
                return 0
        result = stage(src, args.dst, workers=args.workers, part_size=args.part_size,
                       checksum=args.checksum, exclude=args.exclude, unpack_tar=not args.no_unpack,
                       log_interval_s=args.log_interval)
    except URIError as exc:
        print(f"kuberl stage: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:
        print(f"kuberl stage: error: {exc}", file=sys.stderr)
        return 1
    print(f"kuberl stage: {result.source} -> {result.dst}: {result.files} files, {result.bytes} "
          f"bytes; downloaded {result.downloaded_files} ({result.downloaded_bytes} bytes), "
          f"already verified {result.skipped_files}; {result.seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
