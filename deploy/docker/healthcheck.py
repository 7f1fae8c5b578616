"""Container health check: exit 0 when moe-serve answers /v2/health/ready with 200, else 1.

The image's HEALTHCHECK and docker-compose.yml run it (the CUDA runtime image has no curl). The
port is MOE_HTTP_PORT, as the service reads it, else the service's default 8000.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_HTTP_PORT = "8000"  # service.config.Settings.http_port
TIMEOUT_S = 4.0  # under the HEALTHCHECK timeout (5 s), so a slow answer is reported, not killed


def main() -> int:
    port = os.environ.get("MOE_HTTP_PORT", DEFAULT_HTTP_PORT)
    url = f"http://127.0.0.1:{port}/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:  # HTTPError (503: not ready) is a URLError
        sys.stderr.write(f"not ready: {url}: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
