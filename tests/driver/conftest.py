# The real S3 server on loopback (moto), shared with the staging tests.
from tests.storage.conftest import s3, s3_endpoint, s3_env  # noqa: F401
