"""Which values ``redact_secrets`` takes out of user error text before it reaches the job's status
(pure; the real path to the API server is tests/cluster/driver/test_report.py)."""

from kuberl.driver.report import REDACTED, redact_secrets

ENV = {
    # The keys the API docs name for each credentials Secret.
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
    "MLFLOW_TRACKING_TOKEN": "mlflow-token-value",
    "MLFLOW_TRACKING_PASSWORD": "hunter22",
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEYID0001",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "AWS_SESSION_TOKEN": "FwoGZXIvYXdzEXAMPLE",
    "HF_TOKEN": "hf_examplehuggingfacetoken",
    # Not credentials, whatever words they share with one.
    "TOKENIZERS_PARALLELISM": "false",
    "KUBERL_JOB_NAME": "my-job",
    "HOME": "/home/ray",
    # A credential too short to tell from a word.
    "SHORT_KEY": "abc",
}


def test_every_credential_value_is_redacted_and_nothing_else():
    text = " ".join(f"{name}={value}" for name, value in ENV.items()) + " ok=false"
    redacted = redact_secrets(text, ENV)
    for name in ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN"):
        assert ENV[name] not in redacted and f"{name}={REDACTED}" in redacted
    assert "TOKENIZERS_PARALLELISM=false" in redacted and redacted.endswith("ok=false")
    assert "KUBERL_JOB_NAME=my-job" in redacted and "HOME=/home/ray" in redacted and "SHORT_KEY=abc" in redacted


def test_url_user_info_is_redacted():
    text = "mlflow at https://alice:s3cr3t@mlflow.example.com/api failed; s3://bucket/key@v2 not found"
    assert redact_secrets(text, {}) == (f"mlflow at https://{REDACTED}@mlflow.example.com/api failed; "
                                        f"s3://bucket/key@v2 not found")


def test_a_value_inside_a_longer_one_leaves_no_part_behind():
    env = {"A_TOKEN": "abcdef", "B_TOKEN": "xxabcdefyy"}
    assert redact_secrets("xxabcdefyy and abcdef", env) == f"{REDACTED} and {REDACTED}"
