"""The checksums staging verifies: each hasher against its published check value, and which
checksum a store's answer offers."""

import base64
import hashlib

import pytest

from kuberl.storage.checksums import Checksum, Hasher, best, from_s3_response


def b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(4, "big")).decode()


@pytest.mark.parametrize("algorithm, expected", [
    # The CRC catalogue's check values (the CRC of b"123456789"), written as S3 and GCS write
    # them: base64 of the big-endian CRC.
    ("crc32c", b64(0xE3069283)),
    ("crc32", b64(0xCBF43926)),
    ("md5", hashlib.md5(b"123456789").hexdigest()),
])
def test_hasher_matches_the_stores_encoding_across_updates(algorithm, expected):
    hasher = Hasher(algorithm)
    for piece in (b"1234", b"", b"56789"):
        hasher.update(piece)
    assert hasher.value() == expected


def test_s3_response_offers_full_object_crcs_only():
    assert from_s3_response({"ChecksumCRC32": "b==", "ChecksumCRC32C": "c=="}) == \
        Checksum("crc32c", "c==")
    assert from_s3_response({"ChecksumCRC32": "b=="}) == Checksum("crc32", "b==")
    # A multipart upload's composite checksum is over the parts' checksums, not the bytes.
    assert from_s3_response({"ChecksumCRC32C": "c==-3"}) is None
    assert from_s3_response({"ChecksumCRC32C": "c==", "ChecksumType": "COMPOSITE"}) is None
    # CRC64NVME needs awscrt, absent here: the caller falls back to the ETag's MD5.
    assert from_s3_response({"ChecksumCRC64NVME": "AAAAAAAAAAA="}) is None


def test_fastest_checksum_wins_and_md5_only_when_alone():
    md5, crc = Checksum("md5", "0" * 32), Checksum("crc32c", "c==")
    assert best(md5, crc) == crc and best(None, md5) == md5 and best(None, None) is None
