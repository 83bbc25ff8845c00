"""A harness that leaves a process behind: ``python leaky_harness.py PID_FILE exit|hang``.

It starts ``sleep 600``, which inherits its stdout and stderr, writes the sleeper's pid to
PID_FILE, then either plays one turn with its episode key and prints a reward (``exit``) or hangs
(``hang``). Either way the sleeper outlives it unless its process group is killed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

json.load(sys.stdin)
sleeper = subprocess.Popen(["sleep", "600"])
Path(sys.argv[1]).write_text(str(sleeper.pid))
if sys.argv[2] == "hang":
    time.sleep(600)

import httpx  # noqa: E402  (only the playing harness needs it)

response = httpx.post(f"{os.environ['ANTHROPIC_BASE_URL']}/v1/messages", timeout=60,
                      headers={"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"},
                      json={"model": os.environ["KUBERL_MODEL"], "max_tokens": 4,
                            "messages": [{"role": "user", "content": "1+2?"}]})
response.raise_for_status()
print(json.dumps({"reward": 0.5}))
